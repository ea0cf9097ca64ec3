"""`InProcessGroup`: a rank-group backend's one trainer rank run in this process (what the profilers use)
takes the same steps as the single-process trainer, and refuses more than one rank."""

from __future__ import annotations

import pytest

from rlspec.cluster.ray_group import InProcessGroup
from rlspec.core.backend import all_caps, create_backend
from rlspec.spec import SpecError, compile_plan, load_spec
from tests.backends.ranks import TINY, assert_same_steps, fixed_batch, reference_trainer, run_steps

COMMON = ["rollout.prompts_per_step=1", "algorithm.max_grad_norm=0", "algorithm.optimizer=sgd", "algorithm.lr=1e-1",
          "algorithm.micro_batch_size=2", "algorithm.micro_batch_tokens=13"]


@pytest.mark.parametrize("backend_name, extra", [
    ("fsdp", []), ("fsdp", ["hardware.fsdp.reshard_after_forward=true"]),
    pytest.param("deepspeed", [], id="deepspeed-zero1"),  # the stage the plan picks for the tiny model
    pytest.param("deepspeed", ["hardware.deepspeed.zero_stage=3"], id="deepspeed-zero3"),
    # partitioned parameters, fetched and released around each module (every parameter persists on one rank by
    # default); the 2-rank case of tests/backends/deepspeed/test_deepspeed.py runs that path in CI
    pytest.param("deepspeed", ["hardware.deepspeed.zero_stage=3", "hardware.deepspeed.param_persistence_numel=100000"],
                 marks=pytest.mark.slow,
                 id="deepspeed-partitioned"),
    # the tiny model's decoder layers gathered whole (granularity 3,093 values per module), torch's linear
    ("deepspeed", ["hardware.deepspeed.zero_stage=3", "hardware.deepspeed.module_granularity_numel=3200",
                   "hardware.deepspeed.memory_efficient_linear=false"]),
    pytest.param("deepspeed", ["hardware.deepspeed.zero_stage=2"], id="deepspeed-zero2"),
    pytest.param("fsdp", ["model.compile_layers=true"], marks=pytest.mark.slow, id="fsdp-compiled"),
    pytest.param("deepspeed", ["model.compile_layers=true", "hardware.deepspeed.zero_stage=3"], marks=pytest.mark.slow,
                 id="deepspeed-compiled"),
    pytest.param("deepspeed", ["model.compile_layers=true", "hardware.deepspeed.zero_stage=2"], marks=pytest.mark.slow,
                 id="deepspeed-zero2-compiled")])
def test_in_process_rank_matches_single_process_trainer(backend_name, extra):
    pytest.importorskip("ray")
    if backend_name == "deepspeed":
        pytest.importorskip("deepspeed")
    reference_plan = compile_plan(load_spec(TINY, COMMON, "standalone"), all_caps())
    plan = compile_plan(load_spec(TINY, [*COMMON, *extra], backend_name), all_caps())
    batch = fixed_batch()
    reference = reference_trainer(reference_plan)
    expected = run_steps(reference, reference_plan, batch)
    backend = create_backend(backend_name)
    backend.group_class = InProcessGroup
    try:
        backend.setup(plan)
        assert backend.rollout_engine() is None  # ranks only: the caller samples elsewhere
        got = run_steps(backend, plan, batch)
        assert_same_steps(expected, got, backend, reference)
    finally:
        backend.shutdown()
        backend.shutdown()  # twice is fine


@pytest.mark.parametrize("ahead", [True, False])
def test_fsdp_prepare_update_gathers_ahead_and_changes_no_step(ahead):
    """One rank keeps its parameters gathered through an update, so `prepare_update` gathers them before it (while
    the engines would sample). The steps stay the reference's, with a weight push (which shards them again) and a
    prepare between steps; the gather really happened (plain tensors, not DTensors, registered in the module),
    and not with `hardware.fsdp.gather_during_rollout=false`."""
    pytest.importorskip("ray")
    from torch.distributed.tensor import DTensor

    reference_plan = compile_plan(load_spec(TINY, COMMON, "standalone"), all_caps())
    plan = compile_plan(load_spec(TINY, [*COMMON, f"hardware.fsdp.gather_during_rollout={ahead}"], "fsdp"), all_caps())
    batch = fixed_batch()
    reference = reference_trainer(reference_plan)
    expected = run_steps(reference, reference_plan, batch, steps=4)
    backend = create_backend("fsdp")
    backend.group_class = InProcessGroup
    gathered = []

    def push_then_prepare(trainer) -> None:
        dict(trainer.export_weights())
        trainer.prepare_update()
        rank = trainer.group.ranks[0]
        gathered.append(not any(isinstance(p, DTensor) for p in rank.model.parameters()))
        if len(gathered) == 2:  # a save while gathered (a stop during sampling) reads the sharded weights
            dict(trainer.export_weights())

    try:
        backend.setup(plan)
        got = run_steps(backend, plan, batch, steps=4, between=push_then_prepare)
        assert gathered == [ahead] * 3
        assert_same_steps(expected, got, backend, reference)
    finally:
        backend.shutdown()


def test_in_process_group_refuses_two_ranks():
    pytest.importorskip("ray")
    plan = compile_plan(load_spec(TINY, [*COMMON, "hardware.num_trainer_ranks=2"], "fsdp"), all_caps())
    backend = create_backend("fsdp")
    backend.group_class = InProcessGroup
    with pytest.raises(SpecError, match="hardware.num_trainer_ranks"):
        backend.setup(plan)


@pytest.mark.parametrize("omp, num_threads, want", [(None, 0, 1), ("2", 0, 2), (None, 2, 2)])
def test_in_process_rank_runs_with_an_actors_threads(monkeypatch, omp, num_threads, want):
    """The rank's torch threads are a Ray actor's (1 for its half CPU, or OMP_NUM_THREADS, which the actor
    inherits), or `hardware.num_threads`; this process gets its own count back at shutdown."""
    pytest.importorskip("ray")
    import torch

    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    plan = compile_plan(load_spec(TINY, [*COMMON, f"hardware.num_threads={num_threads}"], "fsdp"), all_caps())
    backend = create_backend("fsdp")
    backend.group_class = InProcessGroup
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        backend.setup(plan)
        assert torch.get_num_threads() == want
        backend.shutdown()
        assert torch.get_num_threads() == 3
    finally:
        backend.shutdown()
        torch.set_num_threads(before)
