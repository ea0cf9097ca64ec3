"""Colocated ranks and engines on several GPUs, with Ray's logical GPUs on CPU (`ray.init(num_gpus=8)` and the
`LOGICAL_GPUS_ENV` hook: the run reserves GPUs exactly as a CUDA run does, the tensors stay on CPU).

Each engine must sit on its rank's GPU id and be fed by that rank, every engine exactly once per push; the old
route (trainer rank 0 feeding every engine, which made `gpu2_colocated` fail at its first cuda_ipc push) must
be refused; a layout Ray permuted is re-routed by identity, and one that breaks the plan is refused (exit 2)
before any model is built. 2 ranks run in CI for both backends; 4 and 8 are `slow`.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from rlspec.cluster import ray_group
from rlspec.cluster.placement import LOGICAL_GPUS_ENV, check_beside, sender_seat, verify_route
from rlspec.cluster.ray_utils import ActorWeightSource
from rlspec.core.backend import all_caps, create_backend
from rlspec.core.weights import receive_beside, send_beside
from rlspec.errors import RunError, SpecError
from rlspec.spec import compile_plan, load_spec
from rlspec.sync import build_transport
from tests.backends.ranks import TINY, fixed_batch

pytestmark = pytest.mark.distributed
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def logical_gpus():
    """A private Ray cluster with 8 logical GPUs (and enough logical CPUs for 16 half-CPU actors)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=16, num_gpus=8, object_store_memory=1 << 30, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture
def logical(logical_gpus, monkeypatch):
    monkeypatch.setenv(LOGICAL_GPUS_ENV, "1")


def colocated_plan(backend: str, n: int, *overrides: str):
    spec = load_spec(TINY, [f"hardware.num_trainer_ranks={n}", f"hardware.num_rollout_engines={n}",
                            "hardware.rollout=colocated", "rollout.prompts_per_step=1", "algorithm.micro_batch_size=1",
                            "sync.verify=true", *overrides], backend)
    return compile_plan(spec, all_caps())


def check_colocated(backend_name: str, n: int) -> None:
    plan = colocated_plan(backend_name, n)
    assert plan.sync_method == "ray"
    backend = create_backend(backend_name)
    try:
        backend.setup(plan)
        group, engine = backend.group, backend.rollout_engine()
        # Each engine on its rank's GPU (Ray's ids), and fed by that rank.
        assert [s.gpu_ids for s in group.engine_seats] == [s.gpu_ids for s in group.rank_seats]
        assert len({s.gpu_ids for s in group.rank_seats}) == n
        assert group.feeders == list(range(n))
        source = backend.weight_source()
        # The old route, trainer rank 0 feeding every engine, is refused (engines 1.. are not beside rank 0).
        with pytest.raises(RunError, match=r"(?s)rollout engine [1-9][0-9]* failed.*weights would cross GPUs"):
            verify_route(ActorWeightSource(group.ranks, group.labels, None), engine)
        # A push's fan-out with the weights gathered: one sender seat per engine, the rank on its GPU.
        seen = receive_beside(engine, check_beside, send_beside(source, sender_seat, None))
        assert seen == group.engine_seats
        # Real pushes through the routed `ray` transport, verified, after the weights moved.
        batch = fixed_batch()
        transport = build_transport("ray", plan.spec.sync)
        try:
            transport.connect(engine, source)
            for _ in range(2):
                step_and_push(backend, plan, transport, batch)
        finally:
            transport.close()
    finally:
        backend.shutdown()


def step_and_push(backend, plan, transport, batch) -> None:
    """One optimizer step (the weights move), one push; then every engine's log-probs equal the trainer's."""
    from rlspec.core.grpo import LossNorm

    backend.forward_backward(batch, LossNorm.of(batch.loss_mask, plan.spec.rollout.max_new_tokens))
    backend.optimizer_step()
    engine = backend.rollout_engine()
    assert transport.push(backend.weight_source(), engine) > 0
    trainer = backend.logprobs(batch)
    for i, actor in enumerate(engine.actors):
        got = ray.get(actor.logprobs.remote(batch))
        assert float(((got - trainer) * batch.loss_mask).abs().max()) < 1e-5, f"engine {i}"


@pytest.mark.parametrize("backend_name", ["fsdp", "deepspeed"])
def test_two_colocated_ranks_each_feed_their_engine(logical, backend_name):
    check_colocated(backend_name, 2)


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", ["fsdp", "deepspeed"])
@pytest.mark.parametrize("n", [4, 8])
def test_many_colocated_ranks_each_feed_their_engine(logical, backend_name, n):
    check_colocated(backend_name, n)


def test_layout_checked_by_identity_not_bundle_index(logical, monkeypatch):
    """Made on purpose: engines given GPUs of their own under a colocated plan are refused (exit 2, naming
    hardware.rollout) before any model is built; engines placed in each other's bundles are re-routed."""
    plan = colocated_plan("fsdp", 2)
    planned = ray_group.plan_layout(plan)
    own_gpus = dataclasses.replace(planned, bundles=planned.bundles + [{"CPU": 0.5, "GPU": 1}] * 2,
                                   engine_bundles=[2, 3])
    monkeypatch.setattr(ray_group, "plan_layout", lambda _plan: own_gpus)
    backend = create_backend("fsdp")
    try:
        with pytest.raises(SpecError) as err:
            backend.setup(plan)
        assert err.value.where == "hardware.rollout" and "holds no trainer rank" in str(err.value)
    finally:
        backend.shutdown()
    swapped = dataclasses.replace(planned, engine_bundles=[1, 0])
    monkeypatch.setattr(ray_group, "plan_layout", lambda _plan: swapped)
    backend = create_backend("fsdp")
    try:
        backend.setup(plan)
        group = backend.group
        assert group.feeders == [1, 0]
        assert [s.gpu_ids for s in group.engine_seats] == [group.rank_seats[1].gpu_ids, group.rank_seats[0].gpu_ids]
        transport = build_transport("ray", plan.spec.sync)
        try:
            transport.connect(backend.rollout_engine(), backend.weight_source())
            assert transport.push(backend.weight_source(), backend.rollout_engine()) > 0
        finally:
            transport.close()
    finally:
        backend.shutdown()
    assert torch.get_num_threads() >= 1


def test_split_layout_one_broadcast_reaches_every_engine(logical):
    """Split (engines on GPUs of their own): Ray's GPU ids of ranks and engines are all different, rank 0 sends to
    every engine (no feeders), and one nccl push (gloo on CPU) is a single group broadcasting to both engines."""
    spec = load_spec(TINY, ["hardware.num_trainer_ranks=1", "hardware.num_rollout_engines=2", "hardware.rollout=separate",
                            "rollout.prompts_per_step=2", "algorithm.micro_batch_size=1", "sync.verify=true"], "fsdp")
    plan = compile_plan(spec, all_caps())
    assert plan.sync_method == "nccl"
    backend = create_backend("fsdp")
    try:
        backend.setup(plan)
        group, engine = backend.group, backend.rollout_engine()
        ids = [s.gpu_ids for s in group.rank_seats + group.engine_seats]
        assert len(set(ids)) == 3 and all(len(i) == 1 for i in ids)
        assert group.feeders is None
        transport = build_transport("nccl", plan.spec.sync)
        try:
            transport.connect(engine, backend.weight_source())
            step_and_push(backend, plan, transport, fixed_batch())
        finally:
            transport.close()
    finally:
        backend.shutdown()
