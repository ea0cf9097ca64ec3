"""`algorithm.skip_zero_advantage_updates`: a mini-batch whose gradient is exactly zero is not stepped."""

from __future__ import annotations

import torch

from rlspec.core.batch import TrainBatch
from rlspec.core.step import metrics_row, nothing_to_learn, update
from rlspec.runtime.metrics import PhaseTimer
from rlspec.run import build_plan
from tests.conftest import REPO


class CountingBackend:
    """Records the calls the loop makes; forward_backward returns the statistics a real step would."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def logprobs(self, batch, reference=False):
        self.calls.append("ref_logprobs" if reference else "logprobs")
        return torch.zeros(batch.input_ids.shape)

    def forward_backward(self, batch, norm):
        self.calls.append("forward_backward")
        return {"loss": 1.0, "tokens": float(batch.loss_mask.sum()), "clipped_tokens": 0.0, "entropy_sum": 2.0,
                "kl_sum": 0.0, "is_ratio_sum": 0.0, "is_clipped_tokens": 0.0}

    def optimizer_step(self):
        self.calls.append("optimizer_step")
        return 0.5


def batch_of(advantages: list[float]) -> TrainBatch:
    n = len(advantages)
    mask = torch.zeros(n, 4)
    mask[:, 2:] = 1
    return TrainBatch(input_ids=torch.ones(n, 4, dtype=torch.long), attention_mask=torch.ones(n, 4, dtype=torch.long),
                      loss_mask=mask, advantages=torch.tensor(advantages), rewards=torch.ones(n))


def plan_with(*overrides: str):
    return build_plan(str(REPO / "examples" / "tiny.yaml"),
                      ["rollout.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=1",
                       "algorithm.updates_per_batch=2", "algorithm.skip_zero_advantage_updates=true", *overrides])[0]


def test_only_the_mini_batch_with_nothing_to_learn_is_skipped():
    plan, backend = plan_with(), CountingBackend()
    result = update(plan, backend, batch_of([0.0, 0.0, 1.0, -1.0]))  # first mini-batch: a solved (tied) group
    assert result.skipped == 1 and len(result.grad_norms) == 1
    assert backend.calls == ["logprobs", "forward_backward", "optimizer_step"]
    timer = PhaseTimer(step=1.0)
    row = metrics_row(plan, 0, result, timer, 0)
    assert row["train/skipped_updates"] == 1 and row["loss"] == 1.0 and row["entropy"] == 2.0 / 4  # 2 sequences x 2 loss tokens


def test_a_step_with_nothing_to_learn_computes_nothing_and_logs_zeros():
    plan, backend = plan_with(), CountingBackend()
    result = update(plan, backend, batch_of([0.0] * 4))
    assert backend.calls == [] and result.skipped == 2
    row = metrics_row(plan, 0, result, PhaseTimer(step=1.0), 0)
    assert row["loss"] == 0.0 and row["grad_norm"] == 0.0 and row["entropy"] is None and row["train/skipped_updates"] == 2


def test_skipping_is_off_with_kl_or_when_disabled():
    assert nothing_to_learn(plan_with(), batch_of([0.0] * 4))
    assert not nothing_to_learn(plan_with("algorithm.kl_coef=0.1"), batch_of([0.0] * 4))
    plan, backend = plan_with("algorithm.skip_zero_advantage_updates=false"), CountingBackend()
    assert update(plan, backend, batch_of([0.0] * 4)).skipped == 0
    assert backend.calls.count("optimizer_step") == 2
    # a sequence with no loss tokens (a dropped sample) has nothing to learn whatever its advantage
    dropped = batch_of([3.0, 0.0])
    dropped.loss_mask[0] = 0
    assert nothing_to_learn(plan_with(), dropped)


def test_a_step_whose_samples_were_all_dropped_takes_no_optimizer_step():
    """Every reward failed: no loss token anywhere. Skipped whatever `skip_zero_advantage_updates` says, and the
    row says why (the advantages are left non-zero: the empty mask alone decides)."""
    for flag in ("true", "false"):
        plan, backend = plan_with(f"algorithm.skip_zero_advantage_updates={flag}"), CountingBackend()
        batch = batch_of([1.0, -1.0, 1.0, -1.0])
        batch.loss_mask.zero_()
        result = update(plan, backend, batch)
        assert backend.calls == [] and result.skipped == 2
        row = metrics_row(plan, 0, result, PhaseTimer(step=1.0), 0, {"reward/dropped": 4.0})
        assert row["update/skipped"] == 1 and row["update/skip_reason"] == "every sample was dropped"
        assert row["grad_norm"] == 0.0 and row["loss"] == 0.0


def test_the_row_names_why_a_step_was_skipped_or_that_it_was_not():
    plan = plan_with()
    zero = update(plan, CountingBackend(), batch_of([0.0] * 4))
    assert metrics_row(plan, 0, zero, PhaseTimer(step=1.0), 0)["update/skip_reason"] == "every advantage is zero"
    # one mini-batch dropped, the other learns: the step did step the optimizer
    part = batch_of([1.0, -1.0, 1.0, -1.0])
    part.loss_mask[:2] = 0
    backend = CountingBackend()
    result = update(plan_with("algorithm.skip_zero_advantage_updates=false"), backend, part)
    assert result.skipped == 1 and backend.calls.count("optimizer_step") == 1
    row = metrics_row(plan, 0, result, PhaseTimer(step=1.0), 0)
    assert row["update/skipped"] == 0 and row["update/skip_reason"] is None
