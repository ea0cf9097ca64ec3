"""`deepspeed`: DeepSpeed ZeRO-3 (or ZeRO-2 or ZeRO-1, `hardware.deepspeed.zero_stage`) trainer ranks and `hf` rollout
engines as Ray actors.

The driver (this class) starts one `DeepSpeedWorker` actor per trainer rank and one `EngineWorker` per
rollout engine through the shared rank group (`rlspec.cluster.ray_group.RankGroup`: placement group, process-group
rendezvous, the watchdog, the data-parallel split of each batch). Weights leave the trainer only through
`weight_source()`, which runs a `sync` transport's sender half inside the ranks (all ranks join the
ZeRO-3 gather, rank 0 sends; under ZeRO-1 and ZeRO-2 rank 0 holds the full weights and sends them).
"""

from __future__ import annotations

from pathlib import Path

from ...cluster.ray_group import RankGroupBackend
from ...errors import RunError
from ...spec import RunPlan, SpecError
from .caps import CAPS


class DeepSpeedBackend(RankGroupBackend):
    caps = CAPS

    def setup(self, plan: RunPlan) -> None:
        try:
            import deepspeed  # noqa: F401 - fail here with a clear message, not inside an actor
            import ray  # noqa: F401
        except ImportError as err:
            raise RunError(f"the deepspeed backend needs deepspeed and ray: pip install 'rlspec[deepspeed]' ({err})") from err
        from .worker import DeepSpeedWorker

        # On CPU DeepSpeed must not pick its CUDA accelerator (transformers imports it before `setup` runs).
        self.start_group(plan, DeepSpeedWorker, {} if plan.placement.device == "cuda" else {"DS_ACCELERATOR": "cpu"})

    def load(self, path) -> None:
        """Resume from checkpoint `path` (any backend's; `worker.DeepSpeedWorker.load`). A checkpoint in DeepSpeed's
        own ZeRO-3 layout, which an older rlspec wrote, is refused here under another stage, before any rank reads
        it: bad input (exit 2), not a rank's failure."""
        from .worker import ZERO_DIR

        stage = self.plan.sharding.zero_stage
        if (Path(path) / ZERO_DIR).is_dir() and stage != 3:
            raise SpecError("hardware.deepspeed.zero_stage",
                            f"is {stage}, but {path} holds DeepSpeed's own ZeRO-3 checkpoint ({ZERO_DIR}, written by "
                            "an older rlspec), which only ZeRO-3 reads",
                            "resume with hardware.deepspeed.zero_stage=3")
        super().load(path)
