"""`fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) trainer ranks and `hf` rollout engines as Ray actors.

The driver (this class) starts one `FSDPWorker` actor per trainer rank and one `EngineWorker` per rollout
engine through the shared rank group (`rlspec.cluster.ray_group.RankGroup`: placement group, process-group
rendezvous, the watchdog, the data-parallel split of each batch). Weights leave the trainer only through
`weight_source()`, which runs a `sync` transport's sender half inside the ranks (every rank joins the
bucket-by-bucket gather of the full tensors, rank 0 sends).
"""

from __future__ import annotations

from ...cluster.ray_group import RankGroupBackend
from ...errors import RunError
from ...spec import RunPlan
from .caps import CAPS


class FSDPBackend(RankGroupBackend):
    caps = CAPS

    def setup(self, plan: RunPlan) -> None:
        try:
            import ray  # noqa: F401 - fail here with a clear message, not inside an actor
        except ImportError as err:
            raise RunError(f"the fsdp backend needs ray: pip install 'rlspec[fsdp]' ({err})") from err
        from .worker import FSDPWorker

        self.start_group(plan, FSDPWorker)
