"""The deepspeed backend against the single-process reference, its transports, the watchdog, the CLI.

All tests spawn Ray actors (2 ZeRO-3 ranks on gloo + 1 engine) and share one Ray session per module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlspec.backend import all_caps, create_backend
from rlspec.batch import TrainBatch
from rlspec.grpo import LossNorm
from rlspec.spec import compile_plan, load_spec
from rlspec.sync import build_transport
from rlspec.trainer import LocalTrainer

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny.yaml"


def make_plan(*overrides: str):
    spec = load_spec(TINY, ["hardware.num_trainer_ranks=2", "algorithm.max_grad_norm=0", *overrides], "deepspeed")
    return compile_plan(spec, all_caps())


def fixed_batch(n: int = 8, prompt: int = 5, max_new: int = 8, seed: int = 0) -> TrainBatch:
    """Random sequences with uneven completion lengths; rank 0's half has far more tokens than rank 1's."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [8, 7, 8, 6, 1, 2, 1, 3][:n]
    width = prompt + max(lengths)
    input_ids = torch.randint(4, 260, (n, width), generator=gen)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width)
    for i, length in enumerate(lengths):
        attention_mask[i, :prompt + length] = 1
        loss_mask[i, prompt:prompt + length] = 1
        input_ids[i, prompt + length:] = 0
    rewards = torch.rand(n, generator=gen)
    return TrainBatch(input_ids, attention_mask, loss_mask, advantages=torch.randn(n, generator=gen), rewards=rewards)


def run_steps(trainer, plan, batch: TrainBatch, steps: int = 3) -> list[tuple[float, float, float]]:
    """(loss, grad norm, kl) per step, with old and reference log-probs filled the way `rlspec.loop` does."""
    out = []
    for _ in range(steps):
        step = TrainBatch(**batch.tensors())
        step.old_logprobs = trainer.logprobs(step) + 0.01 * step.loss_mask  # ratio != 1: the clip matters
        if plan.needs_reference_model:
            step.ref_logprobs = trainer.logprobs(step, reference=True)
        stats = trainer.forward_backward(step, LossNorm.of(step.loss_mask, plan.spec.rollout.max_new_tokens))
        out.append((stats["loss"], trainer.optimizer_step(), stats["kl_sum"] / stats["tokens"]))
    return out


def reference_trainer(plan) -> LocalTrainer:
    spec = plan.spec
    return LocalTrainer(spec.model, spec.algorithm, spec.rollout.temperature, spec.rollout.max_new_tokens,
                        needs_reference=plan.needs_reference_model)


CASES = {
    "adamw_token_mean": ["algorithm.optimizer=adamw", "algorithm.lr=1e-2", "algorithm.micro_batch_size=2"],
    "sgd_seq_mean_kl": ["algorithm.optimizer=sgd", "algorithm.lr=1e-1", "algorithm.micro_batch_size=3",
                        "algorithm.loss_agg=seq-mean-token-mean", "algorithm.kl_coef=0.1"],
    "sgd_sum_norm_clip": ["algorithm.optimizer=sgd", "algorithm.lr=1e-1", "algorithm.micro_batch_size=4",
                          "algorithm.loss_agg=seq-mean-token-sum-norm", "algorithm.max_grad_norm=0.05"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_local_trainer_and_transports(ray_session, case):
    plan = make_plan("rollout.prompts_per_step=1", *CASES[case])
    batch = fixed_batch()
    reference = reference_trainer(plan)
    expected = run_steps(reference, plan, batch)
    backend = create_backend("deepspeed")
    try:
        backend.setup(plan)
        got = run_steps(backend, plan, batch)
        for (l_ref, g_ref, k_ref), (l, g, k) in zip(expected, got):
            assert l == pytest.approx(l_ref, abs=1e-5)
            assert g == pytest.approx(g_ref, rel=1e-4, abs=1e-6)
            assert k == pytest.approx(k_ref, abs=1e-6)
        want = dict(reference.export_weights())
        have = dict(backend.export_weights())
        assert set(have) == set(want)  # incl. the tied lm_head.weight
        diff = max(float((have[n] - want[n]).abs().max()) for n in want)
        print(f"\n{case}: max abs weight diff vs LocalTrainer after 3 steps = {diff:.3g}; "
              f"loss/grad_norm/kl per step {got}")
        worst = sorted(((float((have[n] - want[n]).abs().max()), int(((have[n] - want[n]).abs() > 1e-5).sum()), n)
                        for n in want), reverse=True)[:3]
        print("  worst tensors (max diff, #elements > 1e-5, name):", worst)
        assert diff < (2e-4 if "adamw" in case else 1e-6)
        # Every transport this backend offers: after a push, the engine scores like the trainer.
        engine = backend.rollout_engine()
        trainer_logp = backend.logprobs(batch)
        for method in ("ray", "nccl", "checkpoint"):
            transport = build_transport(method, plan.spec.sync)
            try:
                transport.connect(engine, backend.weight_source())
                assert transport.push(backend.weight_source(), engine) > 0
            finally:
                transport.close()
            engine_logp = engine.logprobs(batch)
            err = float(((engine_logp - trainer_logp) * batch.loss_mask).abs().max())
            print(f"  {method}: engine vs trainer logprob max abs diff {err:.3g}")
            assert err < 1e-5
    finally:
        backend.shutdown()
        backend.shutdown()  # idempotent
