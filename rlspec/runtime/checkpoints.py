"""Checkpoint directories under OUT/checkpoints/step_NNNNNN, written atomically, pruned to `keep_last`."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from ..errors import RunError, SpecError

STATE_FILE = "trainer_state.json"


class Checkpoints:
    def __init__(self, root: Path, keep_last: int, save_optimizer: bool) -> None:
        self.root = root
        self.keep_last = keep_last
        self.save_optimizer = save_optimizer

    def save(self, step: int, backend, extra: dict) -> Path:
        """`backend.save` into a staging directory, then rename: a crash or a full disk never leaves a half
        checkpoint, and the previous one stays the latest. A failed write raises `RunError` saying so."""
        final = self.root / f"step_{step:06d}"
        staging = self.root / f".staging_step_{step:06d}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            backend.save(staging)
            if not self.save_optimizer:
                for file in staging.glob("optimizer*"):
                    file.unlink()
            # Written last: a directory counts as a checkpoint only once this file is in it.
            (staging / STATE_FILE).write_text(json.dumps({"step": step, **extra}, indent=2))
            _fsync_tree(staging)
        except (OSError, RunError) as err:
            shutil.rmtree(staging, ignore_errors=True)  # frees what the partial write took
            latest = self.latest()
            kept = f"the latest checkpoint is still {latest}" if latest else "no earlier checkpoint exists"
            problem = "no space left on device" if getattr(err, "errno", None) == errno.ENOSPC else str(err)
            raise RunError(f"writing checkpoint {final.name} failed: {problem}; {kept} — free space and continue "
                           "with --resume") from err
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        old = self.root / f".replaced_step_{step:06d}"
        if final.exists():  # the same step saved again (a resumed run): swap, never delete first
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        staging.rename(final)
        _fsync_dir(self.root)
        shutil.rmtree(old, ignore_errors=True)
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


def check_resumable(checkpoint: Path, model_spec) -> int:
    """The step `checkpoint` was saved after; refuses (`SpecError` on `--resume`) a checkpoint whose state
    file is unreadable or whose weights are corrupt or belong to another model than `model_spec`'s."""
    from ..models.factory import check_weights, preset_config, read_config

    fix = f"resume with the spec that wrote {checkpoint}, or remove that directory to resume from an earlier one"
    try:
        step = step_of(checkpoint)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SpecError("--resume", f"{checkpoint / STATE_FILE} is unreadable ({type(err).__name__})", fix) from None
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise SpecError("--resume", f"{checkpoint} holds no weights (*.safetensors)", fix)
    key = "model.path" if model_spec.path is not None else "model.preset"
    config = read_config(Path(model_spec.path), key) if model_spec.path is not None else preset_config(model_spec.preset)
    try:
        check_weights(files, config, "--resume", strict=True, fix=fix)
    except SpecError as err:
        raise SpecError("--resume", f"checkpoint {checkpoint.name}: {err.problem}", fix) from None
    return step


def _fsync_tree(root: Path) -> None:
    """Flush every file under `root` to disk before the rename publishes it (rename alone orders nothing)."""
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
        else:
            _fsync_dir(path)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
