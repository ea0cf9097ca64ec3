"""`checkpoint.keep_best`: the best checkpoints by an eval metric, kept beside the `keep_last` most recent.

Each eval during training saves a checkpoint; its score is recorded in OUT/checkpoints/best.json before the save
prunes, so pruning (`rlspec.runtime.checkpoints.Checkpoints`) leaves the `keep_best_n` best alone. A checkpoint that
drops out of the best is pruned by the next save unless it is among the last ones. --resume reads the file again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..runtime.checkpoints import Checkpoints
from ..spec import CheckpointSpec

BEST_FILE = "best.json"


class BestCheckpoints:
    def __init__(self, checkpoints: Checkpoints, spec: CheckpointSpec, start_step: int = 0) -> None:
        self.checkpoints = checkpoints
        self.metric = spec.keep_best
        self.n = spec.keep_best_n
        self.sign = 1.0 if spec.keep_best_mode == "max" else -1.0
        self.path = checkpoints.root / BEST_FILE
        self.scores: dict[int, float] = {}
        if self.path.is_file():  # a resumed run: the scores of the steps it keeps
            saved = json.loads(self.path.read_text())
            self.scores = {int(s): v for s, v in saved.get("scores", {}).items() if int(s) < start_step}
        self._protect()

    def record(self, step: int, row: dict) -> bool:
        """Record `row`'s score for the checkpoint of `step` (True: the row has one and it must be saved)."""
        value = row.get(self.metric)
        if not isinstance(value, (int, float)) or math.isnan(value):
            return False
        self.scores[step] = float(value)
        self._protect()
        self.checkpoints.root.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_suffix(".json.tmp")
        staging.write_text(json.dumps({"metric": self.metric, "best": [f"step_{s:06d}" for s in self.best()],
                                       "scores": {str(s): v for s, v in sorted(self.scores.items())}}, indent=2))
        staging.replace(self.path)
        return True

    def best(self) -> list[int]:
        """The steps of the best `n` scores, best first (an earlier step wins a tie)."""
        return sorted(self.scores, key=lambda s: (-self.sign * self.scores[s], s))[:self.n]

    def _protect(self) -> None:
        self.checkpoints.protected = {f"step_{s:06d}" for s in self.best()}


def best_checkpoint(root: Path) -> Path | None:
    """The best checkpoint `best.json` under `root` names (None without one)."""
    path = root / BEST_FILE
    if not path.is_file():
        return None
    best = json.loads(path.read_text()).get("best") or []
    return root / best[0] if best else None
