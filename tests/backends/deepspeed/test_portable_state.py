"""The ZeRO stages in bf16, on one in-process rank each (`InProcessGroup`, no Ray): a run's portable checkpoint
(weights, fp32 masters, AdamW moments and step) loads under another stage and is saved back unchanged, and ZeRO-1
(DeepSpeed's BF16_Optimizer, a different optimizer wrapper from ZeRO-2's and ZeRO-3's) steps as ZeRO-3 does."""

from __future__ import annotations

import pytest
import torch

from rlspec.cluster.ray_group import InProcessGroup
from rlspec.core.backend import all_caps, create_backend
from rlspec.models.factory import read_safetensors_dir
from rlspec.runtime.checkpoints import MASTER_KEY, read_optimizer_state
from rlspec.spec import compile_plan, load_spec
from tests.backends.ranks import TINY, fixed_batch, run_steps

COMMON = ["rollout.prompts_per_step=1", "model.dtype=bfloat16", "algorithm.optimizer=adamw", "algorithm.lr=1e-2",
          "algorithm.micro_batch_size=2", "algorithm.max_grad_norm=0"]


def _backend(stage: int, *extra: str):
    plan = compile_plan(load_spec(TINY, [*COMMON, f"hardware.deepspeed.zero_stage={stage}", *extra], "deepspeed"),
                        all_caps())
    backend = create_backend("deepspeed")
    backend.group_class = InProcessGroup
    backend.setup(plan)
    return plan, backend


@pytest.mark.parametrize("trained, resumed", [(2, 3), (3, 2), (1, 3), (3, 1)])
def test_bf16_checkpoint_crosses_zero_stages_unchanged(trained, resumed, tmp_path):
    plan, backend = _backend(trained)
    try:
        run_steps(backend, plan, fixed_batch(), steps=2)
        backend.save(tmp_path / "trained")
    finally:
        backend.shutdown()
    _, backend = _backend(resumed)
    try:
        backend.load(tmp_path / "trained")
        backend.save(tmp_path / "resumed")
    finally:
        backend.shutdown()
    (want, want_step), (have, have_step) = (read_optimizer_state(tmp_path / d) for d in ("trained", "resumed"))
    assert want_step == have_step == 2
    assert set(have) == set(want) and any(key.endswith(f".{MASTER_KEY}") for key in want)
    # a lost master would come back as the bf16 weight, ~1e-3 relative off the fp32 one
    masters = [key for key in want if key.endswith(f".{MASTER_KEY}")]
    assert any(not torch.equal(want[k], want[k].bfloat16().float()) for k in masters)
    assert all(torch.equal(have[k], want[k]) for k in want), [k for k in want if not torch.equal(have[k], want[k])][:3]
    weights = [read_safetensors_dir(tmp_path / d) for d in ("trained", "resumed")]
    assert all(torch.equal(weights[1][k], weights[0][k]) for k in weights[0])


def test_zero1_steps_as_zero3_in_bf16_with_clipping():
    """Four micro-batches a step, the gradient clipped (its norm is above 0.05), three steps: the same losses and
    norms, and weights far closer to each other than to where they started (both keep fp32 masters and
    accumulate in fp32; bf16 rounding of the weights is what may differ)."""
    runs = []
    for stage in (3, 1):
        plan, backend = _backend(stage, "algorithm.max_grad_norm=0.05")
        try:
            start = {k: w.clone() for k, w in backend.export_weights()}
            runs.append((run_steps(backend, plan, fixed_batch()), dict(backend.export_weights()), start))
        finally:
            backend.shutdown()
    (want, want_weights, start), (have, have_weights, _) = runs
    assert all(norm > 0.05 for _, norm, _ in want)
    for (loss, norm, _), (want_loss, want_norm, _) in zip(have, want, strict=True):
        assert loss == pytest.approx(want_loss, abs=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-4)
    moved = max(float((want_weights[k].float() - w.float()).abs().max()) for k, w in start.items())
    diff = max(float((have_weights[k].float() - want_weights[k].float()).abs().max()) for k in want_weights)
    assert diff <= 0.05 * moved, (diff, moved)


@pytest.mark.gpu
@pytest.mark.parametrize("trained, resumed", [(1, 3), (3, 1)])
def test_cuda_resume_steps_with_the_fused_optimizer(trained, resumed, tmp_path):
    """On CUDA the inner AdamW is fused, which wants its step count on the device: a checkpoint resumed under
    another stage takes its next step and counts on from the saved step."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plan, backend = _backend(trained, "hardware=gpu1")
    try:
        run_steps(backend, plan, fixed_batch(), steps=2)
        backend.save(tmp_path / "trained")
    finally:
        backend.shutdown()
    plan, backend = _backend(resumed, "hardware=gpu1")
    try:
        backend.load(tmp_path / "trained")
        run_steps(backend, plan, fixed_batch(), steps=1)
        backend.save(tmp_path / "resumed")
    finally:
        backend.shutdown()
    assert read_optimizer_state(tmp_path / "resumed")[1] == 3


@pytest.mark.gpu
def test_cuda_zero1_with_the_optimizer_offloaded_steps_as_without():
    """`hardware.offload_optimizer` under ZeRO-1 on CUDA: DeepSpeed then runs its ZeRO-1/2 optimizer with the fp32
    state on the host instead of the BF16_Optimizer (and rlspec's AdamW is not fused): the same steps as the
    on-device ZeRO-1, to the rounding of the host's AdamW against the fused kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    runs = []
    for extra in ([], ["hardware.offload_optimizer=true"]):
        plan, backend = _backend(1, "hardware=gpu1", "algorithm.max_grad_norm=0.05", *extra)
        try:
            runs.append(run_steps(backend, plan, fixed_batch(), steps=3))
        finally:
            backend.shutdown()
    for (loss, norm, _), (want_loss, want_norm, _) in zip(runs[1], runs[0], strict=True):
        assert loss == pytest.approx(want_loss, abs=1e-4)
        assert norm == pytest.approx(want_norm, rel=1e-2)


@pytest.mark.parametrize("stage", [1, 2])
def test_an_old_zero3_checkpoint_under_another_stage_is_bad_input(stage, tmp_path):
    """A checkpoint in DeepSpeed's own ZeRO-3 layout (`optimizer_zero3/`, an older rlspec's) resumed under stage 1 or 2
    is refused by the driver before any rank reads it, with the key and the fix (exit 2 from the CLI)."""
    from rlspec.spec import SpecError

    (tmp_path / "optimizer_zero3").mkdir()
    _, backend = _backend(stage)
    try:
        with pytest.raises(SpecError, match="hardware.deepspeed.zero_stage") as err:
            backend.load(tmp_path)
        assert "zero_stage=3" in str(err.value)
    finally:
        backend.shutdown()
