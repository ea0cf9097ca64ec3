"""`deepspeed`: DeepSpeed ZeRO-3 trainer ranks and `hf` rollout engines as Ray actors.

The driver (this class) places one `DeepSpeedWorker` actor per trainer rank and one `EngineWorker`
per rollout engine in a placement group, then fans every `Backend` call out to the ranks through the
watchdog (`rlspec.ray_utils.wait_all`): if any actor fails or dies, the call raises `RunError` with
that actor's traceback within a fraction of a second, instead of waiting on ranks blocked in a
collective. Weights leave the trainer only through `weight_source()`, which runs a `sync` transport's
sender half inside the ranks (all ranks join the ZeRO-3 gather, rank 0 sends).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor

from ...batch import TrainBatch
from ...errors import RunError
from ...grpo import LossNorm
from ...policy import add_stats
from ...spec import BackendCaps, RunPlan, SpecError

CPUS_PER_ACTOR = 0.5
"""Fractional CPUs per actor on CPU: whole CPUs per actor deadlock a 2-core node (PLATFORM.md)."""


class DeepSpeedBackend:
    caps = BackendCaps(name="deepspeed", model_kinds=("causal_lm",), placements=("colocated", "separate"),
                       sync_methods=("ray", "nccl", "checkpoint", "cuda_ipc"), engines=("hf",), devices=("cpu", "cuda"),
                       supports_lora=False, requires=("deepspeed", "ray"), install_hint="pip install 'rlspec[deepspeed]'")

    def __init__(self) -> None:
        self.plan: RunPlan | None = None
        self.ranks: list[Any] = []
        self.labels: list[str] = []
        self.engines = None
        self.placement_group = None

    # --- setup / teardown ----------------------------------------------------------------------------

    def setup(self, plan: RunPlan) -> None:
        try:
            import deepspeed  # noqa: F401 - fail here with a clear message, not inside an actor
            import ray
        except ImportError as err:
            raise RunError(f"the deepspeed backend needs deepspeed and ray: pip install 'rlspec[deepspeed]' ({err})") from err
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ...ray_utils import start_ray, wait_all
        from ...rollout.remote import start_engines
        from .worker import FAULT_ENV, DeepSpeedWorker

        self.plan = plan
        hw = plan.spec.hardware
        cuda = plan.placement.device == "cuda"
        if cuda and plan.sync_method == "nccl" and plan.placement.rollout == "colocated":
            raise SpecError("sync.method", "sync.method=nccl with hardware.rollout=colocated would put trainer rank 0 "
                            "and engine 0 on one GPU, which one communicator cannot hold",
                            "use sync.method=ray (or auto), or hardware.rollout=separate")
        start_ray(hw.ray_address)
        world, num_engines = hw.num_trainer_ranks, hw.num_rollout_engines
        colocated = plan.placement.rollout == "colocated"
        tp = plan.spec.rollout.tensor_parallel_size
        # One bundle per trainer rank (with its GPU on CUDA). Colocated engines on CUDA share a rank's
        # bundle and GPU (fractional GPU); otherwise (CPU, or separate) each engine gets its own bundle.
        share_gpus = cuda and colocated
        bundles = [{"CPU": CPUS_PER_ACTOR} | ({"GPU": 1} if cuda else {}) for _ in range(world)]
        if share_gpus:
            for i in range(num_engines):
                bundles[i % world]["CPU"] += CPUS_PER_ACTOR
        else:
            bundles += [{"CPU": CPUS_PER_ACTOR} | ({"GPU": tp} if cuda else {}) for _ in range(num_engines)]
        self.placement_group = placement_group(bundles, strategy="PACK")
        try:
            wait_all([self.placement_group.ready()], ["placement group"], timeout_s=120)
        except RunError as err:
            raise RunError(f"could not reserve {bundles} on the Ray cluster: {err}") from None
        gpu_share = (0.5 if share_gpus else 1.0) if cuda else 0
        worker_cls = ray.remote(DeepSpeedWorker)
        fault = os.environ.get(FAULT_ENV)
        self.labels = [f"trainer rank {r}" for r in range(world)]
        self.ranks = [
            worker_cls.options(num_cpus=CPUS_PER_ACTOR, num_gpus=gpu_share, runtime_env=_runtime_env(cuda),
                               scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                                    placement_group_bundle_index=r))
            .remote(plan, r, world, fault)
            for r in range(world)]
        master = wait_all([self.ranks[0].master_address.remote()], self.labels[:1])[0]
        wait_all([rank.setup.remote(master) for rank in self.ranks], self.labels)
        engine_bundles = [(self.placement_group, i % world if share_gpus else world + i) for i in range(num_engines)]
        self.engines = start_engines(plan, engine_bundles, CPUS_PER_ACTOR, (0.5 if share_gpus else tp) if cuda else 0)

    def shutdown(self) -> None:
        from ...ray_utils import kill_all

        kill_all(self.ranks + (self.engines.actors if self.engines is not None else []))
        self.ranks, self.engines = [], None
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001 - already removed, or Ray is gone
                pass
            self.placement_group = None

    # --- the Backend protocol --------------------------------------------------------------------------

    def rollout_engine(self):
        return self.engines

    def _call(self, method: str, per_rank_args: list[tuple]) -> list:
        from ...ray_utils import wait_all

        return wait_all([getattr(rank, method).remote(*args) for rank, args in zip(self.ranks, per_rank_args)],
                        self.labels)

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        world, mbs = len(self.ranks), self.plan.batch.micro_batch_size
        bounds = [(len(batch) * r // world, len(batch) * (r + 1) // world) for r in range(world)]
        parts = [batch.select(a, b) if b > a else batch.select(0, 1) for a, b in bounds]
        num_chunks = max(-(-(b - a) // mbs) for a, b in bounds)
        outs = self._call("logprobs", [(part, num_chunks, reference) for part in parts])
        width = batch.input_ids.shape[1]
        return torch.cat([out[:, :width] for out, (a, b) in zip(outs, bounds) if b > a], dim=0)

    def forward_backward(self, batch: TrainBatch, norm: LossNorm) -> dict[str, float]:
        world = len(self.ranks)
        if len(batch) % world:
            raise RunError(f"{len(batch)} sequences do not split evenly over {world} trainer ranks")
        stats = self._call("forward_backward", [(batch.shard(r, world), norm) for r in range(world)])
        peak = max((s.pop("peak_mem_gb", 0.0) for s in stats), default=0.0)
        total = add_stats(*stats)
        if peak:
            total["peak_mem_gb"] = peak
        return total

    def optimizer_step(self) -> float:
        return self._call("optimizer_step", [()] * len(self.ranks))[0]

    def weight_source(self):
        """Where the full weights are produced: inside the ranks (see `rlspec.weights.WeightSource`)."""
        from ...ray_utils import ActorWeightSource

        return ActorWeightSource(self.ranks, self.labels)

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        from ...weights import collect_cpu

        yield from self.weight_source().run_sender(collect_cpu, None)

    def save(self, path: Path) -> None:
        self._call("save", [(str(path), self.plan.spec.checkpoint.save_optimizer)] * len(self.ranks))

    def load(self, path: Path) -> None:
        self._call("load", [(str(path),)] * len(self.ranks))

    def pids(self) -> dict[str, int]:
        """Process ids of every actor (for operators and the watchdog test)."""
        pids = dict(zip(self.labels, self._call("pid", [()] * len(self.ranks))))
        pids.update(zip(self.engines.labels, self.engines.pids()))
        return pids


def _runtime_env(cuda: bool) -> dict:
    """On `hardware.device=cpu` hide GPUs from the ranks: DeepSpeed would otherwise pick its CUDA
    accelerator on a GPU machine (transformers imports it before `setup` runs) and move the model there."""
    return {} if cuda else {"env_vars": {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}}
