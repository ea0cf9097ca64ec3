"""`fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) trainer ranks and `hf` rollout engines as Ray actors.

The driver (this class) starts one `FSDPWorker` actor per trainer rank and one `EngineWorker` per rollout
engine through the shared rank group (`rlspec.ray_group.RankGroup`: placement group, process-group
rendezvous, the watchdog, the data-parallel split of each batch). Weights leave the trainer only through
`weight_source()`, which runs a `sync` transport's sender half inside the ranks (every rank joins the
bucket-by-bucket gather of the full tensors, rank 0 sends).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from torch import Tensor

from ...batch import TrainBatch
from ...errors import RunError
from ...grpo import LossNorm
from ...spec import BackendCaps, RunPlan


class FSDPBackend:
    caps = BackendCaps(name="fsdp", model_kinds=("causal_lm",), placements=("colocated", "separate"),
                       sync_methods=("ray", "nccl", "checkpoint", "cuda_ipc"), engines=("hf",), devices=("cpu", "cuda"),
                       supports_lora=True, requires=("ray",), install_hint="pip install 'rlspec[fsdp]'")

    def __init__(self) -> None:
        self.plan: RunPlan | None = None
        self.group = None

    def setup(self, plan: RunPlan) -> None:
        try:
            import ray  # noqa: F401 - fail here with a clear message, not inside an actor
        except ImportError as err:
            raise RunError(f"the fsdp backend needs ray: pip install 'rlspec[fsdp]' ({err})") from err
        from ...ray_group import RankGroup
        from .worker import FSDPWorker

        self.plan = plan
        self.group = RankGroup(plan)
        self.group.start(FSDPWorker)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()

    # --- the Backend protocol --------------------------------------------------------------------------

    def rollout_engine(self):
        return self.group.engines

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        return self.group.logprobs(batch, reference)

    def forward_backward(self, batch: TrainBatch, norm: LossNorm) -> dict[str, float]:
        return self.group.forward_backward(batch, norm)

    def optimizer_step(self) -> float:
        return self.group.call_all("optimizer_step")[0]

    def weight_source(self):
        """Where the full weights are produced: inside the ranks (see `rlspec.weights.WeightSource`)."""
        return self.group.weight_source()

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        from ...weights import collect_cpu

        yield from self.weight_source().run_sender(collect_cpu, None)

    def save(self, path: Path) -> None:
        self.group.call_all("save", str(path), self.plan.spec.checkpoint.save_optimizer)

    def load(self, path: Path) -> None:
        self.group.call_all("load", str(path))

    def actors(self) -> list:
        """(label, handle) of every actor, for the stall detector's stack dump."""
        return self.group.actors() if self.group is not None else []

    def pids(self) -> dict[str, int]:
        """Process ids of every actor (for operators and the watchdog test)."""
        return self.group.pids()
