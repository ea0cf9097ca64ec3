"""The no-gradient log-prob passes score the policy in eval mode on every backend, and the update trains in train mode.

With dropout in the model (LoRA's on standalone and fsdp, after a step has moved the adapters off B = 0; DeepSpeed,
which trains no LoRA, the attention dropout of the model's config), two passes over the same weights agree exactly,
the old log-probs of an update with `updates_per_batch > 1` are those passes' (the ratio pi / pi_old of the weights
the update starts from is exactly 1), and the policy is in train mode again for the update. The rank-group
backends' one rank runs in this process (`InProcessGroup`), the code of a Ray actor's rank.
"""

from __future__ import annotations

import pytest
import torch

from rlspec.core.backend import all_caps, create_backend
from rlspec.core.batch import TrainBatch
from rlspec.core.step import update
from rlspec.spec import compile_plan, load_spec
from tests.backends.ranks import TINY, fixed_batch, reference_trainer, run_steps

COMMON = ["rollout.prompts_per_step=1", "algorithm.group_size=8", "algorithm.micro_batch_size=2",
          "algorithm.optimizer=adamw", "algorithm.lr=1e-1"]
LORA_DROPOUT = ["model.lora.r=4", "model.lora.dropout=0.5"]


@pytest.fixture(scope="module")
def attention_dropout_model(tmp_path_factory):
    """The tiny preset's shape with `attention_dropout: 0.5` in its config (random init, saved as a directory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlspec.models.base import byte_tokenizer

    path = tmp_path_factory.mktemp("attention_dropout")
    config = AutoConfig.for_model("qwen2", vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  attention_dropout=0.5, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def policy_module(backend) -> torch.nn.Module:
    """The module the backend trains: the single-process trainer's, or the in-process rank's (FSDP2 or ZeRO-3)."""
    if hasattr(backend, "model"):
        return backend.model
    rank = backend.group.ranks[0]
    return rank.model if hasattr(rank, "model") and rank.model is not None else rank.engine


@pytest.mark.parametrize("backend_name", ["standalone", "fsdp", "deepspeed"])
def test_no_grad_passes_run_in_eval_mode_and_the_first_ratio_is_one(backend_name, attention_dropout_model):
    pytest.importorskip("ray")
    if backend_name == "deepspeed":
        pytest.importorskip("deepspeed")
    from rlspec.cluster.ray_group import InProcessGroup

    dropout = [f"model.path={attention_dropout_model}"] if backend_name == "deepspeed" else LORA_DROPOUT
    plan = compile_plan(load_spec(TINY, [*COMMON, *dropout], backend_name), all_caps())
    if backend_name == "standalone":
        backend = reference_trainer(plan)  # the standalone backend's trainer
    else:
        backend = create_backend(backend_name)
        backend.group_class = InProcessGroup
        backend.setup(plan)
    batch = fixed_batch()
    try:
        run_steps(backend, plan, batch, steps=1)  # LoRA's B leaves 0: the adapters' dropout now changes the output
        policy = policy_module(backend)
        first, second = backend.logprobs(batch), backend.logprobs(batch)
        print(f"\n{backend_name}: two no-gradient passes differ by {float((first - second).abs().max()):.3g}")
        assert torch.equal(first, second)
        assert all(module.training for module in policy.modules())  # train mode again for the update
        if backend_name == "standalone":  # the engine of `sync.method=shared` scores the trainer's own module
            from rlspec.rollout.hf import HFEngine

            engine = HFEngine(policy, backend.tokenizer, plan.spec.rollout, "cpu", plan.batch.micro_batch_size)
            assert torch.equal(engine.logprobs(batch), first)
        two = compile_plan(load_spec(TINY, [*COMMON, *dropout, "algorithm.updates_per_batch=2"], backend_name),
                           all_caps())
        result = update(two, backend, TrainBatch(**batch.tensors()))
        assert len(result.grad_norms) == 2
        assert torch.equal(result.batch.old_logprobs, first)  # pi / pi_old = 1 at the weights the update starts from
    finally:
        if backend_name != "standalone":
            backend.shutdown()
