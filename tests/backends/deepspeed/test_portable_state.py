"""The portable checkpoint between ZeRO stages, on one in-process rank each (`InProcessGroup`, no Ray): a bf16 run's
checkpoint (weights, fp32 masters, AdamW moments and step) loads under the other stage and is saved back unchanged."""

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


def _backend(stage: int):
    plan = compile_plan(load_spec(TINY, [*COMMON, f"hardware.deepspeed.zero_stage={stage}"], "deepspeed"), all_caps())
    backend = create_backend("deepspeed")
    backend.group_class = InProcessGroup
    backend.setup(plan)
    return plan, backend


@pytest.mark.parametrize("trained, resumed", [(2, 3), (3, 2)])
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
