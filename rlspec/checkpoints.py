"""Checkpoint directories under OUT/checkpoints/step_NNNNNN, written atomically, pruned to `keep_last`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

STATE_FILE = "trainer_state.json"


class Checkpoints:
    def __init__(self, root: Path, keep_last: int, save_optimizer: bool) -> None:
        self.root = root
        self.keep_last = keep_last
        self.save_optimizer = save_optimizer

    def save(self, step: int, backend, extra: dict) -> Path:
        """`backend.save` into a staging directory, then rename: a crash never leaves a half checkpoint."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:06d}"
        staging = self.root / f".staging_step_{step:06d}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        backend.save(staging)
        if not self.save_optimizer:
            for file in staging.glob("optimizer*"):
                file.unlink()
        (staging / STATE_FILE).write_text(json.dumps({"step": step, **extra}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        self._prune()
        return final

    def latest(self) -> Path | None:
        done = self.completed()
        return done[-1] if done else None

    def completed(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("step_*") if (p / STATE_FILE).is_file())

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for old in self.completed()[:-self.keep_last]:
            shutil.rmtree(old)


def step_of(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / STATE_FILE).read_text())["step"])
