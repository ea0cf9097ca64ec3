"""The Ray rank group shared by the data-parallel backends (`deepspeed`, `fsdp`): placement, actors, fan-out.

Driver side, `RankGroup` reserves one placement group (one bundle per trainer rank, its GPU on CUDA, plus
the rollout engines' bundles), starts one worker actor per rank, hands every rank rank 0's address for the
process-group rendezvous, places the engines (`rlspec.rollout.remote.start_engines`), and fans every
`Backend` call out to the ranks through the watchdog (`rlspec.cluster.ray_utils.wait_all`): if any actor fails or
dies, the call raises `RunError` with that actor's traceback within a fraction of a second, instead of
waiting on ranks blocked in a collective with it. The data-parallel split of a batch over the ranks
(`logprobs`, `forward_backward`) lives here too, so the backends differ only in their workers.

Driver side, `RankGroupBackend` is the `Backend` protocol over a `RankGroup`. Worker side, a backend's worker
class subclasses `RankWorker` (its place in the group, the `FaultInjector` test hook, `pid`,
`master_address`, its `seat`, the sender half `run_sender`, stack dumps) and implements `setup(master)`,
`logprobs(part, num_chunks, reference)`, `forward_backward(shard, norm, sizes)`, `optimizer_step`,
`full_weights(keep)`, `save`, `load`, and may override `prepare_update`; `sharded_logprobs` helps.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import torch
from torch import Tensor

from ..core.batch import TrainBatch
from ..core.grpo import LossNorm
from ..core.policy import PEAK_STATS, add_stats, batch_logprobs
from ..errors import RunError
from ..perf.rank_trace import RankTracer, trace_env
from ..runtime.stall import StackReporter
from ..spec import RunPlan, SpecError
from .placement import CPUS_PER_ACTOR, Seat, describe_layout, plan_layout, route_engines, uses_gpus, verify_route

FAULT_ENV = "RLSPEC_FAULT_INJECT"
"""Test hook, `rank=R,step=S,mode=raise|exit|hang|oom`: rank R fails in its S-th forward_backward (0-based);
`hang` first lets a side thread die with an exception (the kind Ray only writes to the worker's log), then blocks;
`oom` runs out of memory (on CUDA a real allocation past the GPU's size)."""


class RankGroup:
    """Trainer-rank actors (and the rollout engines) of one run, in one placement group."""

    def __init__(self, plan: RunPlan) -> None:
        self.plan = plan
        self.ranks: list[Any] = []
        self.labels: list[str] = []
        self.engines = None
        self.placement_group = None
        self.rank_seats: list[Seat] = []
        self.engine_seats: list[Seat] = []
        self.feeders: list[int] | None = None
        """Engine i is fed by trainer rank `feeders[i]`; None: rank 0 sends to every engine at once."""
        self.preparing: list = []
        """Futures of `prepare_update` on the ranks, waited on before the next call."""

    def start(self, worker_cls: type, env_vars: dict[str, str] | None = None) -> None:
        """Place and start the ranks (`worker_cls` actors) and the engines; `env_vars` go to the ranks.

        Every actor first reports its seat (`rlspec.cluster.placement`); the engines' feeders are decided from
        those (or the layout refused, exit 2) before any model is built."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ..rollout.remote import create_engines
        from ..runtime.stall import remote_class
        from .ray_utils import check_cluster_fits, start_ray, wait_all

        plan, hw = self.plan, self.plan.spec.hardware
        cuda = plan.placement.device == "cuda"
        if cuda and plan.sync_method == "nccl" and plan.placement.rollout == "colocated":
            raise SpecError("sync.method", "sync.method=nccl with hardware.rollout=colocated would put trainer rank 0 "
                            "and engine 0 on one GPU, which one communicator cannot hold",
                            "use sync.method=ray (or auto), or hardware.rollout=separate")
        world = hw.num_trainer_ranks
        layout = plan_layout(plan)
        if hw.ray_address is None:
            check_cluster_fits(layout.bundles, None)  # a local cluster's CPUs: refused before one is started
        start_ray(hw.ray_address)
        check_cluster_fits(layout.bundles, hw.ray_address)
        self.placement_group = placement_group(layout.bundles, strategy=hw.placement_strategy)
        try:
            wait_all([self.placement_group.ready()], ["placement group"], timeout_s=120)
        except RunError as err:
            raise RunError(f"could not reserve {layout.bundles} on the Ray cluster: {err}") from None
        # On CPU hide GPUs from the ranks: a library that finds one would move the model there. (Not under the
        # logical-GPU test hook: Ray would then report the ranks' GPUs as none.)
        env = ({} if uses_gpus(plan) else {"CUDA_VISIBLE_DEVICES": ""}) | (env_vars or {})
        remote_cls = remote_class(worker_cls)  # worker classes inherit `rlspec.runtime.stall.StackReporter`
        env |= trace_env()  # RLSPEC_RANK_TRACE: each rank records a train phase and a push
        fault = os.environ.get(FAULT_ENV)
        self.labels = [f"trainer rank {r}" for r in range(world)]
        self.ranks = [
            remote_cls.options(num_cpus=CPUS_PER_ACTOR, num_gpus=layout.rank_gpus,
                               runtime_env={"env_vars": env} if env else {},
                               scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                                    placement_group_bundle_index=b))
            .remote(plan, r, world, fault)
            for r, b in enumerate(layout.rank_bundles)]
        self.engines = create_engines(plan, [(self.placement_group, b) for b in layout.engine_bundles], CPUS_PER_ACTOR,
                                      layout.engine_gpus)
        engine_actors = self.engines.actors
        seats = wait_all([a.seat.remote() for a in self.ranks + engine_actors], self.labels + self.engines.labels)
        self.rank_seats, self.engine_seats = seats[:world], seats[world:]
        self.feeders = route_engines(plan, self.rank_seats, self.engine_seats)
        print(f"rlspec: placement\n{describe_layout(self.rank_seats, self.engine_seats, self.feeders)}",
              file=sys.stderr, flush=True)
        if self.feeders is not None:  # the push's own fan-out, once, before any model is built
            verify_route(self.weight_source(), self.engines)
        master = wait_all([self.ranks[0].master_address.remote()], self.labels[:1])[0]
        self.call_all("setup", master)
        self.engines.build()

    def shutdown(self) -> None:
        """Kill the actors and remove the placement group (idempotent)."""
        from .ray_utils import kill_all

        kill_all(self.ranks + (self.engines.actors if self.engines is not None else []))
        self.ranks, self.engines = [], None
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001 - already removed, or Ray is gone
                pass
            self.placement_group = None

    # --- fan-out ---------------------------------------------------------------------------------------

    def call(self, method: str, per_rank_args: list[tuple]) -> list:
        """`method(*args)` on every rank (one tuple per rank), waited on through the watchdog (after any
        `prepare_update` still under way, so its failure is reported)."""
        from .ray_utils import wait_all

        self._settle()
        try:
            return wait_all([getattr(rank, method).remote(*args) for rank, args in zip(self.ranks, per_rank_args)],
                            self.labels)
        except RunError as err:
            raise out_of_memory(self.plan, method, err) or err

    def call_all(self, method: str, *args) -> list:
        return self.call(method, [args] * len(self.ranks))

    def prepare_update(self) -> None:
        """Start `prepare_update` on every rank and return at once: the ranks run it while the engines sample
        (an actor runs its calls in order, so the update's calls start after it)."""
        self._settle()
        self.preparing = [rank.prepare_update.remote() for rank in self.ranks]

    def _settle(self) -> None:
        """Wait for the ranks' `prepare_update` if still under way (raising `RunError` if one failed)."""
        preparing, self.preparing = self.preparing, []
        if preparing:
            from .ray_utils import wait_all

            wait_all(preparing, self.labels)

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        """Split `batch` over the ranks; every rank runs the same number of forwards (see `sharded_logprobs`)."""
        world, mbs = len(self.ranks), self.plan.batch.micro_batch_size
        bounds = [(len(batch) * r // world, len(batch) * (r + 1) // world) for r in range(world)]
        parts = [batch.select(a, b) if b > a else batch.select(0, 1) for a, b in bounds]
        num_chunks = max(-(-(b - a) // mbs) for a, b in bounds)
        outs = self.call("logprobs", [(part, num_chunks, reference) for part in parts])
        width = batch.input_ids.shape[1]
        return torch.cat([out[:, :width] for out, (a, b) in zip(outs, bounds) if b > a], dim=0)

    def forward_backward(self, batch: TrainBatch, norm: LossNorm) -> dict[str, float]:
        """Each rank accumulates gradients on its shard: contiguous and even (as even as the rows allow), or with
        `algorithm.micro_batch_tokens` balanced by real tokens (`TrainBatch.token_shards`); statistics summed,
        memory peak maxed."""
        world = len(self.ranks)
        budget = self.plan.spec.algorithm.micro_batch_tokens
        if budget:
            args = [(shard, norm, sizes) for shard, sizes in batch.token_shards(world, budget)]
        elif len(batch) % world:  # a mini-batch of a batch whose size varies (`rlspec.core.step.mini_batch_bounds`)
            args = [(shard, norm, sizes) for shard, sizes in batch.row_shards(world, self.plan.batch.micro_batch_size)]
        else:
            args = [(batch.shard(r, world), norm, None) for r in range(world)]
        stats = self.call("forward_backward", args)
        peaks = {key: max((s.pop(key, 0.0) for s in stats), default=0.0) for key in PEAK_STATS}
        total = add_stats(*stats)
        total.update({key: peak for key, peak in peaks.items() if peak})
        return total

    def weight_source(self):
        """The ranks as a `rlspec.core.weights.WeightSource`: every rank gathers; rank 0 runs the sender half, or
        in a colocated layout every rank with an engine beside it runs it for that engine (`feeders`)."""
        from .ray_utils import ActorWeightSource

        return ActorWeightSource(self.ranks, self.labels, self.feeders)

    def actors(self) -> list[tuple[str, Any]]:
        """(label, handle) of every actor, for the stall detector's stack dump."""
        engines = self.engines
        return list(zip(self.labels, self.ranks)) + (list(zip(engines.labels, engines.actors)) if engines else [])

    def pids(self) -> dict[str, int]:
        """Process ids of every actor (for operators and the watchdog test)."""
        pids = dict(zip(self.labels, self.call_all("pid")))
        pids.update(zip(self.engines.labels, self.engines.pids()))
        return pids


def out_of_memory(plan: RunPlan, method: str, err: RunError) -> RunError | None:
    """A rank's failure that is torch's out-of-memory error, as a `RunError` that names the knob to turn (the
    rank's traceback kept); None for any other failure."""
    text = str(err)
    if "OutOfMemoryError" not in text and "CUDA out of memory" not in text:
        return None
    algorithm = plan.spec.algorithm
    budget = (f"algorithm.micro_batch_tokens={algorithm.micro_batch_tokens}" if algorithm.micro_batch_tokens
              else f"algorithm.micro_batch_size={algorithm.micro_batch_size}")
    first = text.splitlines()[0]
    return RunError(f"{first}: out of GPU memory in {method} at {budget} per micro-batch — lower it (e.g. halve it), "
                    "or set model.gradient_checkpointing=true or hardware.offload_optimizer=true",
                    err.worker_traceback)


def actor_threads() -> int:
    """The intra-op threads a rank actor starts with: OMP_NUM_THREADS where the environment sets it (the actor
    inherits it), else what Ray sets it to, the actor's whole CPUs and at least 1."""
    return int(os.environ.get("OMP_NUM_THREADS") or 0) or max(math.floor(CPUS_PER_ACTOR), 1)


class InProcessGroup(RankGroup):
    """One trainer rank in this process, called directly: no Ray, no engines (world size 1).

    For the profilers (`python -m rlspec.perf.profile_train --backend fsdp`): torch.profiler, the sync debug
    mode and a Chrome trace see the rank's own kernels and host work, which inside a Ray actor they would not.
    The rank runs exactly the code it runs as an actor; the batch split and statistics are `RankGroup`'s.

    Threads too: Ray starts an actor that asks for less than one CPU (`CPUS_PER_ACTOR`) with OMP_NUM_THREADS=1,
    so a rank's CPU ops run on one thread; here torch's intra-op threads are set to the same (or to
    `hardware.num_threads`, which the rank sets itself) while the rank lives. With this process's default (a thread
    a core), the deepspeed ZeRO-1 rank's batch packing took 5-10 ms per CPU op instead of tens of microseconds,
    55 ms of a 0.18 s train phase on an H200 machine's 16 cores, a cost the actor never pays.
    """

    _threads: int | None = None

    def start(self, worker_cls: type, env_vars: dict[str, str] | None = None) -> None:
        if self.plan.spec.hardware.num_trainer_ranks != 1:
            raise SpecError("hardware.num_trainer_ranks", "an in-process rank group holds exactly one trainer rank",
                            "set hardware.num_trainer_ranks=1")
        os.environ.update(env_vars or {})
        self._threads = torch.get_num_threads()
        torch.set_num_threads(actor_threads())
        worker = worker_cls(self.plan, 0, 1)
        self.ranks, self.labels = [worker], ["trainer rank 0"]
        worker.setup(worker.master_address())

    def shutdown(self) -> None:
        ranks, self.ranks = self.ranks, []
        for rank in ranks:
            rank.teardown()
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None

    def call(self, method: str, per_rank_args: list[tuple]) -> list:
        return [getattr(rank, method)(*args) for rank, args in zip(self.ranks, per_rank_args)]

    def prepare_update(self) -> None:
        """In this process nothing runs beside the engine: the ranks prepare now, before it samples."""
        self.call_all("prepare_update")

    def weight_source(self):
        """The rank itself: its `run_sender` is the `WeightSource` hook."""
        return self.ranks[0]

    def pids(self) -> dict[str, int]:
        return {self.labels[0]: os.getpid()}


class RankGroupBackend:
    """The `Backend` protocol over a `RankGroup`, for a data-parallel backend whose ranks are Ray actors.

    A backend class (`deepspeed`, `fsdp`) declares its `caps` and a `setup` that checks its imports and calls
    `start_group(plan, worker_cls)`; everything else fans out to its worker actors the same way. (A core
    helper, not a backend: backends still never import or subclass each other.) Setting `group_class` to
    `InProcessGroup` before `setup` runs the one rank in this process instead (the profilers do).
    """

    group_class: type[RankGroup] = RankGroup

    def __init__(self) -> None:
        self.plan: RunPlan | None = None
        self.group: RankGroup | None = None

    def start_group(self, plan: RunPlan, worker_cls: type, env_vars: dict[str, str] | None = None) -> None:
        self.plan = plan
        self.group = self.group_class(plan)
        self.group.start(worker_cls, env_vars)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()

    def rollout_engine(self):
        return self.group.engines

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        return self.group.logprobs(batch, reference)

    def forward_backward(self, batch: TrainBatch, norm: LossNorm) -> dict[str, float]:
        return self.group.forward_backward(batch, norm)

    def optimizer_step(self) -> float:
        return self.group.call_all("optimizer_step")[0]

    def prepare_update(self) -> None:
        """The ranks' `prepare_update`, run while the engines sample the batch of the next update."""
        self.group.prepare_update()

    def weight_source(self):
        """Where the full weights are produced: inside the ranks (see `rlspec.core.weights.WeightSource`)."""
        return self.group.weight_source()

    def export_weights(self):
        from ..core.weights import collect_cpu

        yield from self.weight_source().run_sender(collect_cpu, None)

    def save(self, path) -> None:
        self.group.call_all("save", str(path), self.plan.spec.checkpoint.save_optimizer)

    def load(self, path) -> None:
        self.group.call_all("load", str(path))

    def actors(self) -> list:
        """(label, handle) of every actor, for the stall detector's stack dump."""
        return self.group.actors() if self.group is not None else []

    def pids(self) -> dict[str, int]:
        """Process ids of every actor (for operators and the watchdog test)."""
        return self.group.pids()


# --- worker-side helpers ------------------------------------------------------------------------------


def sharded_logprobs(model: torch.nn.Module, part: TrainBatch, num_chunks: int, micro_batch_size: int,
                     temperature: float, device: torch.device) -> Tensor:
    """Log-probs of this rank's `part` in exactly `num_chunks` micro-batch forwards.

    A sharded model's forward is collective (parameters are gathered), so a rank with a shorter part
    pads it with copies of its first sequence and throws their log-probs away.
    """
    size = num_chunks * micro_batch_size
    n = len(part)
    index = torch.cat([torch.arange(n), torch.zeros(max(size - n, 0), dtype=torch.long)])
    padded = TrainBatch.from_tensors({k: v[index] for k, v in part.tensors().items()})
    return batch_logprobs(model, padded, temperature, micro_batch_size, device)[:n]


class RankWorker(StackReporter):
    """What every rank actor shares: its place in the group, the fault hook, its pid, the rendezvous address.
    (Stack dumps come from `StackReporter`; the actor class is made remote with `stall.remote_class`.)"""

    def __init__(self, plan: RunPlan, rank: int, world_size: int, fault: str | None = None) -> None:
        self.plan = plan
        self.rank = rank
        self.world_size = world_size
        self.maybe_fail = FaultInjector(fault, rank)
        self.tracer = RankTracer(rank)
        """`rlspec.perf.rank_trace`: one train phase and one push under the profiler when asked for."""

    def pid(self) -> int:
        return os.getpid()

    def seat(self):
        """Where this rank runs (`rlspec.cluster.placement.Seat`), asked before any model is built."""
        from .placement import this_seat

        return this_seat()

    def run_sender(self, fn, payload, gather: bool = True, senders: tuple[int, ...] = (0,)) -> Any:
        """A transport's sender half (see `rlspec.core.weights.WeightSource`): every rank joins the gathers; the
        ranks in `senders` (rank 0, or in a colocated layout each rank with an engine beside it) run `fn` on
        their own full copy, the others drain the gathers."""
        if gather:
            self.tracer.begin("push")
        try:
            if self.rank in senders:
                return fn(self.full_weights(keep=True) if gather else None, payload)
            if gather:
                for _ in self.full_weights(keep=False):
                    pass
            return None
        finally:
            self.tracer.end("push")

    def full_weights(self, keep: bool):
        """Every rank iterates this together (each step may be a collective gather): the full weights by HF
        state-dict name, one `sync.bucket_mb` group at a time; with `keep=False` the rank only takes part."""
        raise NotImplementedError

    def prepare_update(self) -> None:
        """Work for the next update that can run while the engines sample (the rank is idle then). None here."""

    def place(self) -> torch.device:
        """This rank's torch threads and device (on CUDA, Ray exposes exactly this actor's GPU as device 0)."""
        if self.plan.spec.hardware.num_threads:
            torch.set_num_threads(self.plan.spec.hardware.num_threads)
        if self.plan.placement.device != "cuda":
            return torch.device("cpu")
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)

    def teardown(self) -> None:
        """Leave the process group (a rank run in its caller's process; an actor is killed instead)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def master_address(self) -> tuple[str, int]:
        """This rank's node address and a free port, where rank 0 hosts the process-group rendezvous."""
        from .ray_utils import node_address

        return node_address()


class FaultInjector:
    """The `FAULT_ENV` test hook inside a rank: call it once per `forward_backward`."""

    def __init__(self, text: str | None, rank: int) -> None:
        self.rank = rank
        self.calls = 0
        self.fault = None
        if text:
            fields = dict(item.split("=", 1) for item in text.split(","))
            self.fault = {"rank": int(fields["rank"]), "step": int(fields["step"]), "mode": fields.get("mode", "raise")}

    def __call__(self) -> None:
        call, self.calls = self.calls, self.calls + 1
        if self.fault and self.fault["rank"] == self.rank and self.fault["step"] == call:
            if self.fault["mode"] == "exit":
                os._exit(3)
            if self.fault["mode"] == "oom":
                if torch.cuda.is_available():  # a real one: more than any GPU holds
                    torch.empty(1 << 46, dtype=torch.uint8, device="cuda")
                raise torch.OutOfMemoryError(f"injected fault ({FAULT_ENV}): out of memory on trainer rank {self.rank}")
            if self.fault["mode"] == "hang":
                self._hang()
            raise RuntimeError(f"injected fault ({FAULT_ENV}) on trainer rank {self.rank} at call {call}")

    def _hang(self) -> None:
        import threading
        import time

        def lost_thread() -> None:
            raise RuntimeError(f"injected fault ({FAULT_ENV}): a side thread of trainer rank {self.rank} died")

        threading.Thread(target=lost_thread, name="rlspec-fault").start()
        while True:
            time.sleep(3600)
