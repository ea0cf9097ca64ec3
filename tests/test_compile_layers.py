"""`model.compile_layers`: the regionally compiled train forward/backward computes what the plain one does, on
packed micro-batches of changing lengths, without recompiling for a new length."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rlspec.core.grpo import LossNorm
from rlspec.core.trainer import LocalTrainer
from rlspec.models.base import DTYPES
from rlspec.models.factory import load_model
from rlspec.spec import AlgorithmSpec, ModelSpec
from tests.test_packing import LENGTHS, ragged_batch


def _step(trainer: LocalTrainer, batch, norm) -> tuple[float, dict[str, torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    stats = trainer.forward_backward(batch, norm)
    return stats["loss"], {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.slow  # Inductor compiles for ~20 s per case on a CPU
@pytest.mark.parametrize("impl, lora", [("eager", 0), ("sdpa", 0), ("eager", 4)], ids=["eager", "sdpa", "eager-lora"])
def test_compiled_layers_train_like_plain_ones(impl, lora):
    from torch._dynamo.utils import counters

    from rlspec.spec import LoraSpec

    algo = AlgorithmSpec(micro_batch_tokens=20)  # packed micro-batches of 11 to 20 tokens
    plain = LocalTrainer(ModelSpec(attn_implementation=impl, lora=LoraSpec(r=lora)), algo, 1.0, 16)
    compiled = LocalTrainer(ModelSpec(attn_implementation=impl, lora=LoraSpec(r=lora), compile_layers=True),
                            algo, 1.0, 16)
    assert len(compiled.compiled.blocks) == plain.model.config.num_hidden_layers
    graphs = counters["stats"]["unique_graphs"]
    for step, lengths in enumerate([LENGTHS, [5, 7, 2, 13, 8, 3, 11, 6]]):
        batch, _ = ragged_batch(lengths, seed=step)
        norm = LossNorm.of(batch.loss_mask, 16)
        want_loss, want = _step(plain, batch, norm)
        # After the first step, a new packed length must reuse the dynamic graphs, not compile new ones.
        guard = torch._dynamo.config.patch(error_on_recompile=True) if step else contextlib.nullcontext()
        with guard:
            got_loss, got = _step(compiled, batch, norm)
        assert got_loss == pytest.approx(want_loss, abs=1e-5)
        for key, grad in want.items():
            torch.testing.assert_close(got[key], grad, rtol=0, atol=1e-5, msg=key)
    assert counters["stats"]["unique_graphs"] > graphs  # the blocks did run compiled
    # Off the train step (log-probs, a shared rollout engine) the blocks run their plain forward again.
    assert all("forward" not in vars(block) for block, _ in compiled.compiled.blocks)


@pytest.mark.gpu
def test_compiled_layers_on_cuda_bf16_are_as_close_to_fp32_as_plain():
    """On CUDA in bf16 an sdpa model's packed forward runs torch's varlen flash kernel: compiled, the step's loss
    and gradients are as close to the fp32 reference as the plain bf16 step's, and new lengths do not recompile."""
    algo = AlgorithmSpec(micro_batch_tokens=256)

    def trainer(dtype: str, compile_layers: bool) -> LocalTrainer:
        spec = ModelSpec(attn_implementation="sdpa", dtype=dtype, compile_layers=compile_layers)
        model = load_model(ModelSpec(attn_implementation="sdpa"), seed=0).to(DTYPES[dtype])  # one init, cast
        return LocalTrainer(spec, algo, 1.0, 16, device="cuda", model=model)

    runs = {"ref": trainer("float32", False), "plain": trainer("bfloat16", False),
            "compiled": trainer("bfloat16", True)}
    for step, lengths in enumerate([[40, 7, 130, 1, 64, 90, 3, 128], [33, 120, 5, 77, 200, 9, 61, 14]]):
        batch, _ = ragged_batch(lengths, seed=step)
        norm = LossNorm.of(batch.loss_mask, 16)
        results = {}
        for name, run in runs.items():
            guard = torch._dynamo.config.patch(error_on_recompile=True) if step else contextlib.nullcontext()
            with guard:
                loss, grads = _step(run, batch, norm)
            results[name] = (loss, torch.cat([g.float().flatten() for g in grads.values()]))
        (ref_loss, ref_grad), (plain_loss, plain_grad), (loss, grad) = results.values()
        assert abs(loss - ref_loss) <= 2 * abs(plain_loss - ref_loss) + 1e-3, (loss, plain_loss, ref_loss)
        plain_err, err = (plain_grad - ref_grad).abs().max(), (grad - ref_grad).abs().max()
        assert err <= 2 * plain_err + 1e-3, (float(err), float(plain_err))
