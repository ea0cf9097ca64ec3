"""Which trainer rank feeds which engine, decided from the seats the actors report (no Ray here: the seats
are made up, including the layouts Ray must never produce), and the plan's refusals of layouts that cannot
route."""

from __future__ import annotations

import pytest

from rlspec.cluster.placement import LOGICAL_GPUS_ENV, Seat, plan_layout, route_engines
from rlspec.core.backend import all_caps
from rlspec.errors import SpecError
from rlspec.spec import compile_plan, load_spec
from tests.backends.ranks import TINY


def plan_of(*overrides: str, backend: str = "fsdp"):
    return compile_plan(load_spec(TINY, ["algorithm.micro_batch_size=1", *overrides], backend), all_caps())


def gpu(i: int, node: str = "n0") -> Seat:
    return Seat(node, (str(i),), (f"GPU-{node}-{i}",))


def colocated(n: int):
    return plan_of("hardware.device=cuda", f"hardware.num_trainer_ranks={n}", f"hardware.num_rollout_engines={n}",
                   "hardware.rollout=colocated")


@pytest.mark.parametrize("n", [2, 4, 8])
def test_colocated_engine_fed_by_the_rank_on_its_gpu(n):
    plan = colocated(n)
    ranks = [gpu(i) for i in range(n)]
    assert route_engines(plan, ranks, [gpu(i) for i in range(n)]) == list(range(n))
    # Ray placed the engines in another order: routed by identity, not by index.
    permuted = [gpu((i + 1) % n) for i in range(n)]
    assert route_engines(plan, ranks, permuted) == [(i + 1) % n for i in range(n)]


def test_colocated_layouts_that_break_the_plan_are_refused():
    plan = colocated(2)
    ranks = [gpu(0), gpu(1)]
    with pytest.raises(SpecError) as err:  # an engine on a GPU no rank holds
        route_engines(plan, ranks, [gpu(0), gpu(2)])
    assert err.value.where == "hardware.rollout" and "rollout engine 1" in str(err.value) and "no trainer rank" in str(err.value)
    with pytest.raises(SpecError) as err:  # two engines beside one rank
        route_engines(plan, ranks, [gpu(1), gpu(1)])
    assert err.value.where == "hardware.num_rollout_engines" and "engines 0 and 1" in str(err.value)
    with pytest.raises(SpecError):  # one node's GPU 0 is not another node's GPU 0
        route_engines(plan, ranks, [gpu(0), gpu(1, node="n1")])


def test_logical_gpus_are_told_apart_by_node_and_id():
    plan = colocated(2)
    logical = [Seat("n0", ("0",), ()), Seat("n0", ("1",), ())]
    assert route_engines(plan, logical, logical[::-1]) == [1, 0]


def test_separate_layout_refuses_shared_gpus():
    plan = plan_of("hardware.device=cuda", "hardware.num_trainer_ranks=2", "hardware.num_rollout_engines=2",
                   "hardware.rollout=separate")
    assert route_engines(plan, [gpu(0), gpu(1)], [gpu(2), gpu(3)]) is None  # rank 0 broadcasts to all
    with pytest.raises(SpecError) as err:
        route_engines(plan, [gpu(0), gpu(1)], [gpu(2), gpu(1)])
    assert err.value.where == "hardware.rollout" and "trainer rank 1 holds too" in str(err.value)
    with pytest.raises(SpecError) as err:
        route_engines(plan, [gpu(0), gpu(1)], [gpu(2), gpu(2)])
    assert "rollout engine 0 holds too" in str(err.value)


def test_cpu_engines_fed_by_a_rank_on_their_node():
    plan = plan_of("hardware.num_trainer_ranks=2", "hardware.num_rollout_engines=2")
    cpu = [Seat("n0", (), ()), Seat("n1", (), ())]
    assert route_engines(plan, cpu, cpu) == [0, 1]
    assert route_engines(plan, cpu, [cpu[1], cpu[1]]) == [1, 1]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_layout_bundles(n, monkeypatch):
    """Colocated on CUDA: one GPU bundle per rank, each engine half of its rank's; separate: engines' own."""
    layout = plan_layout(colocated(n))
    assert layout.bundles == [{"CPU": 1.0, "GPU": 1}] * n
    assert layout.engine_bundles == layout.rank_bundles == list(range(n))
    assert layout.rank_gpus == layout.engine_gpus == 0.5
    split = plan_layout(plan_of("hardware.device=cuda", f"hardware.num_trainer_ranks={n}",
                                f"hardware.num_rollout_engines={n}", "hardware.rollout=separate"))
    assert split.bundles == [{"CPU": 0.5, "GPU": 1}] * n + [{"CPU": 0.5, "GPU": 1}] * n
    assert split.engine_bundles == list(range(n, 2 * n)) and split.rank_gpus == split.engine_gpus == 1.0
    cpu = plan_of(f"hardware.num_trainer_ranks={n}", f"hardware.num_rollout_engines={n}")
    assert plan_layout(cpu).rank_gpus == 0 and "GPU" not in plan_layout(cpu).bundles[0]
    monkeypatch.setenv(LOGICAL_GPUS_ENV, "1")  # the test hook: a CPU run reserves GPUs as a CUDA run would
    assert plan_layout(cpu).bundles == [{"CPU": 1.0, "GPU": 1}] * n


@pytest.mark.parametrize("overrides, key", [
    (["hardware.num_rollout_engines=3"], "hardware.num_rollout_engines"),  # 3 colocated engines on 2 ranks' GPUs
    (["sync.method=nccl"], "sync.method"),  # one communicator cannot hold two members on one GPU
    (["hardware.rollout=separate", "sync.method=cuda_ipc"], "sync.method"),  # IPC needs one GPU
])
def test_plan_refuses_layouts_that_cannot_route(overrides, key):
    with pytest.raises(SpecError) as err:
        plan_of("hardware.device=cuda", "hardware.num_trainer_ranks=2", "hardware.num_rollout_engines=2",
                "hardware.rollout=colocated", *overrides)
    assert err.value.where == key


def test_a_cluster_too_small_for_the_bundles_is_refused_before_and_after_ray_starts(monkeypatch):
    """Before a local cluster starts only its CPUs are known; once Ray is up, a cluster that lists no GPUs has none."""
    ray = pytest.importorskip("ray")
    from rlspec.cluster import ray_utils

    gpu_bundles = [{"CPU": 0.5, "GPU": 1}] * 2
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_utils, "local_cpus", lambda: 2)
    ray_utils.check_cluster_fits(gpu_bundles, None)  # GPUs unknown yet: not refused here
    with pytest.raises(SpecError, match="need 4.5 CPUs, the local Ray cluster has 2 in all"):
        ray_utils.check_cluster_fits([{"CPU": 0.5}] * 9, None)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    with pytest.raises(SpecError, match="need 2 GPUs, the Ray cluster at ray://head:10001 has 0 in all"):
        ray_utils.check_cluster_fits(gpu_bundles, "ray://head:10001")
