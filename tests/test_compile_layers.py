"""`model.compile_layers`: the regionally compiled train forward/backward computes what the plain one does, on
packed micro-batches of changing lengths, without recompiling for a new length."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rlspec.core.grpo import LossNorm
from rlspec.core.trainer import LocalTrainer
from rlspec.spec import AlgorithmSpec, ModelSpec
from tests.test_packing import LENGTHS, ragged_batch


def _step(trainer: LocalTrainer, batch, norm) -> tuple[float, dict[str, torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    stats = trainer.forward_backward(batch, norm)
    return stats["loss"], {k: p.grad.clone() for k, p in trainer.model.named_parameters()}


@pytest.mark.slow  # Inductor compiles for ~20 s per attention kind on a CPU
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_compiled_layers_train_like_plain_ones(impl):
    from torch._dynamo.utils import counters

    algo = AlgorithmSpec(micro_batch_tokens=20)  # packed micro-batches of 11 to 20 tokens
    plain = LocalTrainer(ModelSpec(attn_implementation=impl), algo, 1.0, 16)
    compiled = LocalTrainer(ModelSpec(attn_implementation=impl, compile_layers=True), algo, 1.0, 16)
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
