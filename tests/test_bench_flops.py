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


def test_rows_are_per_gpu():
    """Two colocated ranks that each reach a third of the peak read 33% MFU, not 67% (the bench printed two GPUs'
    tokens/s against one GPU's peak); rows say their GPU counts and per-GPU rates."""
    from rlspec.perf.bench import summarise

    one, _ = build_plan(str(REPO / "examples" / "tiny.yaml"), ["hardware=gpu1"])
    two, _ = build_plan(str(REPO / "examples" / "tiny.yaml"), ["hardware=gpu2_colocated"], "fsdp")
    split, _ = build_plan(str(REPO / "examples" / "tiny.yaml"), ["hardware=gpu4_split"], "fsdp")
    row = {"perf/tokens_per_s": 600.0, "timing_s/step": 2.0, "timing_s/train": 0.5, "train/skipped_updates": 0}
    per_one = TrainFlops(one, peak_tflops=1.0, num_gpus=1).mfu(row)
    assert TrainFlops(two, peak_tflops=1.0, num_gpus=2).mfu(row) == pytest.approx(per_one / 2)
    got = summarise([dict(row), dict(row)], 0, TrainFlops(two, 1.0, 2), two)
    assert (got["gpus/trainer"], got["gpus/engine"], got["gpus/total"]) == (2, 2, 2)
    assert got["perf/tokens_per_s_per_gpu"] == pytest.approx(300.0)
    assert got["perf/samples_per_s"] == pytest.approx(two.batch.sequences_per_step / 2.0)
    assert got["perf/samples_per_s_per_gpu"] == pytest.approx(got["perf/samples_per_s"] / 2)
    got = summarise([dict(row)], 0, None, split)
    assert (got["gpus/trainer"], got["gpus/engine"], got["gpus/total"]) == (2, 2, 4)
    assert got["perf/tokens_per_s_per_gpu"] == pytest.approx(150.0)
    cpu = summarise([dict(row)], 0, None, build_plan(str(REPO / "examples" / "tiny.yaml"), [])[0])
    assert cpu["gpus/total"] == 0 and cpu["perf/tokens_per_s_per_gpu"] is None
