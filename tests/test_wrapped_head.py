"""The chunked LM head inside a backend's wrapper (FSDP2's root module, the ZeRO-3 engine, PEFT under FSDP2):
the wrapped model's forward never forms the [.., V] logits of the whole micro-batch, and its log-probs,
entropies and gradients are the unwrapped model's.

One process, a gloo group of world size 1: the wrappers' gathers, hooks and gradient reductions run as on
several ranks, without starting any. The chunk is shrunk to a few positions so that a tiny model shows it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rlspec.core import grpo, policy
from rlspec.core.batch import TrainBatch
from rlspec.models.factory import apply_lora, load_model
from rlspec.spec import ModelSpec

ROWS = 3
CHUNK_ELEMS = ROWS * 2 * 260  # 2 positions of 3 rows (6 of the packed row) at the tiny vocabulary


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    import torch.distributed as dist

    env = dict(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    if "deepspeed" in sys.modules:  # through DeepSpeed, which drops its references to the group too
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()
    else:
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(policy, "token_logprobs_and_entropy",
                        functools.partial(grpo.token_logprobs_and_entropy, chunk_elems=CHUNK_ELEMS))


class VocabSized(TorchDispatchMode):
    """Records the largest tensor with a last dimension of `vocab` that any op makes (logits are [.., V]), other
    than views of the head's weight: its [H, V] transpose, broadcast (stride 0) over the rows for a matmul."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.largest = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab
                    and t.numel() != self.vocab * self.hidden and 0 not in t.stride()):
                self.largest = max(self.largest, t.numel())
        return out


def make_batch() -> TrainBatch:
    ids = torch.randint(4, 260, (ROWS, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    mask[2, 9:] = 0
    return TrainBatch(ids, mask, mask.float(), advantages=torch.ones(ROWS), rewards=torch.zeros(ROWS))


def check_against_unwrapped(wrapped, plain, named_grads, backward, packed: bool) -> None:
    """Log-probs, entropies and every gradient of `wrapped` (through `policy.sequence_logprobs`) equal `plain`'s,
    and no op on the wrapped path makes a [.., V] tensor bigger than one chunk."""
    [(mb, packing)] = list(make_batch().split([ROWS], "cpu", packed))
    weights = torch.randn(mb.input_ids.shape, generator=torch.Generator().manual_seed(1))
    vocab = plain.config.vocab_size
    outputs = []
    head = policy._base_model(wrapped).get_output_embeddings()
    hook = head.register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        with VocabSized(vocab, plain.config.hidden_size) as seen:
            logp, entropy = policy.sequence_logprobs(wrapped, mb, 0.7, packing)
            backward((logp * weights).sum())
    finally:
        hook.remove()
    [out] = outputs
    assert isinstance(out, tuple) and all(t.shape[-1] != vocab for t in out)  # the head's output: no logits
    tokens = int(mb.attention_mask.sum()) if packed else mb.input_ids.numel()
    assert 0 < seen.largest <= CHUNK_ELEMS < tokens * vocab  # chunks, never the whole micro-batch's logits
    want_logp, want_entropy = policy.sequence_logprobs(plain, mb, 0.7, packing)
    (want_logp * weights).sum().backward()
    assert torch.allclose(logp, want_logp, atol=1e-6, rtol=0)
    assert torch.allclose(entropy, want_entropy, atol=1e-6, rtol=0)
    grads = named_grads()
    checked = [name for name, p in plain.named_parameters() if p.grad is not None]
    head_weight = plain.get_output_embeddings().weight
    assert checked and (not head_weight.requires_grad or any(plain.get_parameter(n) is head_weight for n in checked))
    for name in checked:
        assert torch.allclose(grads[name], plain.get_parameter(name).grad, atol=1e-5, rtol=0), name


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("lora_r", [0, 4])
def test_fsdp2_root_runs_the_chunked_head(world_of_one, small_chunks, packed, lora_r):
    from torch.distributed.device_mesh import init_device_mesh

    from rlspec.backends.fsdp.worker import shard_model

    spec = ModelSpec()
    spec = dataclasses.replace(spec, lora=dataclasses.replace(spec.lora, r=lora_r))
    plain = apply_lora(load_model(spec, seed=0), spec, 0)
    for name, p in plain.named_parameters():
        if "lora_B" in name:  # B = 0 at the start: the adapters' A would get no gradient
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(2))
    wrapped = shard_model(copy.deepcopy(plain), init_device_mesh("cpu", (1,)), torch.float32, offload=False)
    assert policy._decoder_and_head(wrapped) is None and policy.packs(wrapped, make_batch())

    def named_grads():
        return {name: p.grad.full_tensor() for name, p in wrapped.named_parameters() if p.grad is not None}

    check_against_unwrapped(wrapped, plain, named_grads, lambda loss: loss.backward(), packed)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.filterwarnings(r"ignore:`torch\.distributed\.\w+` is deprecated:FutureWarning")  # DeepSpeed's calls
def test_zero3_engine_runs_the_chunked_head(world_of_one, small_chunks, packed):
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.utils import safe_get_full_grad

    plain = load_model(ModelSpec(), seed=0)
    model = copy.deepcopy(plain)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # every weight partitioned
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=config)
    assert policy._decoder_and_head(engine) is None

    def named_grads():
        return {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}

    check_against_unwrapped(engine, plain, named_grads, engine.backward, packed)
