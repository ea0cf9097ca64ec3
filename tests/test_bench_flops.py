"""The bench's train-phase FLOP count and MFU (`rlspec.perf.bench.TrainFlops`)."""

from __future__ import annotations

import pytest

from rlspec.perf.bench import TrainFlops, train_tokens_per_s
from rlspec.run import build_plan
from tests.conftest import REPO


def test_mfu_by_hand_and_none_for_a_step_that_skipped_updates():
    plan, _ = build_plan(str(REPO / "examples" / "tiny.yaml"), [])
    flops = TrainFlops(plan, peak_tflops=1.0)
    assert flops.passes == 3  # forward + backward, one update, no KL
    tokens = 1000.0
    mean_len = tokens / plan.batch.sequences_per_step
    want = 3 * tokens * (2 * flops.matmul_params + 2 * mean_len * flops.attn_width) / (0.5 * 1e12)
    row = {"perf/tokens_per_s": 500.0, "timing_s/step": 2.0, "timing_s/train": 0.5, "train/skipped_updates": 0}
    assert flops.mfu(row) == pytest.approx(want)
    assert flops.mfu(row | {"train/skipped_updates": 1}) is None  # nothing (or less) was computed
    assert flops.mfu(row | {"timing_s/train": 0.0}) is None
    assert train_tokens_per_s(row) == pytest.approx(1000.0 / 0.5)  # the step's real tokens over the train phase
    assert train_tokens_per_s(row | {"train/skipped_updates": 1}) is None
