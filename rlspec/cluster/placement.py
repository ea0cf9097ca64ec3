"""Where a run's actors sit, and which trainer rank feeds which rollout engine: planned from the spec, then
checked against what Ray actually gave each actor (its GPU's identity), never trusted from a bundle index.

`plan_layout` turns the plan into Ray placement-group bundles: one per trainer rank (with its GPU on CUDA);
colocated engines on CUDA take half of a rank's bundle (and so its GPU), other engines get bundles of their
own. Ray has had bugs where a fractional-GPU actor did not land on its bundle's GPU, so before any model is
built every rank and engine reports its `Seat` (node, Ray's GPU ids, the GPUs' UUIDs as CUDA names them), and
`route_engines` decides from those alone:

- colocated: each engine must share its GPU with exactly one trainer rank, and that rank feeds it (a layout
  Ray permuted is re-routed by identity; an engine on a GPU no rank holds, or two engines on one rank's GPU,
  is refused: exit 2 naming `hardware.rollout` and the fix). Every rank that has an engine beside it runs
  the transport's sender half on its own gathered copy of the weights, so no weight byte crosses GPUs.
  On CPU (no GPUs) an engine is fed by a rank on its node, engine i by rank i where it can.
- separate: no engine may share a GPU with a rank or with another engine (one NCCL communicator cannot hold
  two of its members on one GPU); trainer rank 0 sends to every engine at once.

`LOGICAL_GPUS_ENV` is a test hook: a CPU run then reserves Ray GPUs exactly as a CUDA run would, so that with
`ray.init(num_gpus=N)` the placement and routing of a several-GPU run are exercised on a machine without GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import RunError, SpecError

CPUS_PER_ACTOR = 0.5
"""Fractional CPUs per actor on CPU: whole CPUs per actor deadlock a 2-core node (PLATFORM.md)."""
COLOCATED_GPU_SHARE = 0.5
"""The fraction of its GPU a colocated rank, and the engine beside it, each ask Ray for."""
LOGICAL_GPUS_ENV = "RLSPEC_LOGICAL_GPUS"
"""Test hook (driver side): `1` makes a `hardware.device=cpu` run reserve Ray GPUs as a CUDA run would."""


@dataclass(frozen=True)
class Layout:
    """The placement group a plan asks for, and where each rank and engine goes in it."""

    bundles: list[dict[str, float]]
    rank_bundles: list[int]
    engine_bundles: list[int]
    rank_gpus: float
    """GPUs each rank actor asks for (0 on CPU)."""
    engine_gpus: float


def uses_gpus(plan) -> bool:
    """Whether the run reserves Ray GPUs: on CUDA, or on CPU under the `LOGICAL_GPUS_ENV` test hook."""
    return plan.placement.device == "cuda" or os.environ.get(LOGICAL_GPUS_ENV) == "1"


def plan_layout(plan) -> Layout:
    """The bundles of the module docstring for `plan`."""
    hw = plan.spec.hardware
    world, num_engines = hw.num_trainer_ranks, hw.num_rollout_engines
    tp = plan.spec.rollout.tensor_parallel_size
    gpus = uses_gpus(plan)
    share = gpus and plan.placement.rollout == "colocated"
    bundles = [{"CPU": CPUS_PER_ACTOR} | ({"GPU": 1} if gpus else {}) for _ in range(world)]
    if share:
        for i in range(num_engines):
            bundles[i % world]["CPU"] += CPUS_PER_ACTOR
        engine_bundles = [i % world for i in range(num_engines)]
    else:
        bundles += [{"CPU": CPUS_PER_ACTOR} | ({"GPU": tp} if gpus else {}) for _ in range(num_engines)]
        engine_bundles = [world + i for i in range(num_engines)]
    rank_gpus = (COLOCATED_GPU_SHARE if share else 1.0) if gpus else 0.0
    engine_gpus = (COLOCATED_GPU_SHARE if share else float(tp)) if gpus else 0.0
    return Layout(bundles, list(range(world)), engine_bundles, rank_gpus, engine_gpus)


@dataclass(frozen=True)
class Seat:
    """Where one actor runs, as the actor itself sees it."""

    node: str
    gpu_ids: tuple[str, ...]
    """Ray's ids of the GPUs assigned to the actor (logical ones under `LOGICAL_GPUS_ENV`)."""
    uuids: tuple[str, ...]
    """The physical GPUs' UUIDs as CUDA reports them, one per visible device (empty without CUDA)."""

    def gpus(self) -> frozenset[str]:
        """The GPUs this actor holds, by identity: the physical UUID where CUDA gives one, else node and Ray id."""
        if self.uuids:
            return frozenset(self.uuids)
        return frozenset(f"{self.node[:12]}/gpu{g}" for g in self.gpu_ids)

    def describe(self) -> str:
        if not self.gpu_ids and not self.uuids:
            return f"node {self.node[:12]} (no GPU)"
        ids = ",".join(self.gpu_ids) or "?"
        return f"GPU {ids} ({', '.join(sorted(self.gpus()))})"


def this_seat() -> Seat:
    """The calling actor's `Seat` (call it before building a model: nothing here allocates device memory)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
    uuids: tuple[str, ...] = ()
    if gpu_ids:
        import torch

        if torch.cuda.is_available():
            uuids = tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))
    return Seat(node, gpu_ids, uuids)


def route_engines(plan, ranks: list[Seat], engines: list[Seat]) -> list[int] | None:
    """Which trainer rank feeds each engine (`feeders[i]` for engine i), or None where trainer rank 0 sends to
    every engine at once (a separate layout); raises `SpecError` where the seats break the plan."""
    if plan.placement.rollout != "colocated":
        _check_separate(ranks, engines)
        return None
    if not any(seat.gpus() for seat in ranks + engines):  # CPU: an engine is fed by a rank on its node
        feeders = []
        for i, seat in enumerate(engines):
            local = [r for r, rank in enumerate(ranks) if rank.node == seat.node] or [0]
            feeders.append(i % len(ranks) if i % len(ranks) in local else local[0])
        return feeders
    feeders, fed = [], {}
    for i, seat in enumerate(engines):
        beside = [r for r, rank in enumerate(ranks) if rank.gpus() & seat.gpus()]
        if len(beside) != 1:
            where = "no trainer rank" if not beside else f"trainer ranks {beside}"
            raise SpecError("hardware.rollout", f"colocated rollout engine {i} landed on {seat.describe()}, which holds "
                            f"{where}; the plan puts each engine on its own trainer rank's GPU. Seats: "
                            f"{_seats(ranks, engines)}",
                            "check that Ray sees each GPU once (CUDA_VISIBLE_DEVICES of `ray start`), or use "
                            "hardware.rollout=separate")
        if beside[0] in fed:
            raise SpecError("hardware.num_rollout_engines", f"rollout engines {fed[beside[0]]} and {i} both landed "
                            f"on trainer rank {beside[0]}'s {seat.describe()}; the plan gives each engine a GPU of "
                            f"its own. Seats: {_seats(ranks, engines)}",
                            "check that Ray sees each GPU once (CUDA_VISIBLE_DEVICES of `ray start`)")
        fed[beside[0]] = i
        feeders.append(beside[0])
    return feeders


def _check_separate(ranks: list[Seat], engines: list[Seat]) -> None:
    held = {gpu: f"trainer rank {r}" for r, seat in enumerate(ranks) for gpu in seat.gpus()}
    for i, seat in enumerate(engines):
        for gpu in sorted(seat.gpus()):
            if gpu in held:
                raise SpecError("hardware.rollout", f"rollout engine {i} landed on {seat.describe()}, which "
                                f"{held[gpu]} holds too; hardware.rollout=separate gives engines GPUs of their own "
                                f"(one NCCL communicator cannot hold two members on one GPU). Seats: "
                                f"{_seats(ranks, engines)}",
                                "check that Ray sees each GPU once (CUDA_VISIBLE_DEVICES of `ray start`), or use "
                                "hardware.rollout=colocated")
            held[gpu] = f"rollout engine {i}"


def _seats(ranks: list[Seat], engines: list[Seat]) -> str:
    return "; ".join([f"trainer rank {r}: {s.describe()}" for r, s in enumerate(ranks)]
                     + [f"rollout engine {i}: {s.describe()}" for i, s in enumerate(engines)])


def describe_layout(ranks: list[Seat], engines: list[Seat], feeders: list[int] | None) -> str:
    """One line per engine: where it runs and who feeds it (printed at start, so the layout is in run.log)."""
    lines = [f"trainer rank {r}: {s.describe()}" for r, s in enumerate(ranks)]
    for i, seat in enumerate(engines):
        fed = f"fed by trainer rank {feeders[i]}" if feeders is not None else "fed by trainer rank 0 (broadcast)"
        lines.append(f"rollout engine {i}: {seat.describe()}, {fed}")
    return "\n".join(lines)


def sender_seat(named, _payload=None) -> Seat:
    """A sender half that moves no weights: the seat of the rank that runs it (`verify_route`)."""
    for _ in named or ():
        pass
    return this_seat()


def check_beside(_engine, sender: Seat) -> Seat:
    """An engine half that moves no weights: refuse a sender that is not beside this engine (on its GPU, or on
    its node without GPUs); return this engine's seat."""
    mine = this_seat()
    beside = bool(mine.gpus() & sender.gpus()) if (mine.gpus() or sender.gpus()) else mine.node == sender.node
    if not beside:
        raise RunError(f"a colocated engine on {mine.describe()} was fed by a trainer rank on {sender.describe()}: "
                        "weights would cross GPUs (the route of `rlspec.cluster.placement`)")
    return mine


def verify_route(source, engines) -> list[Seat]:
    """Run the fan-out a colocated push uses (`sync.base.send_beside` / `receive_beside`) with no weights: every
    engine must receive exactly one sender's seat, and that sender must be beside it. Returns the engines' seats
    in engine order."""
    from ..core.weights import receive_beside, send_beside

    return receive_beside(engines, check_beside, send_beside(source, sender_seat, None, gather=False))
