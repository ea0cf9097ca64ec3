"""Checkpoint directories under OUT/checkpoints/step_NNNNNN, written atomically, pruned to `keep_last`.

What a checkpoint holds is the same whichever backend and rank count wrote it, so any backend at any rank count
resumes it: the HF model (`model.safetensors`, `from_pretrained` loads it) and the optimizer state by parameter
name, not by shard layout, in the folder `optimizer/` (`OPTIMIZER_DIR`; beside the model, a loader of
`*.safetensors` would take it for weights):
- `optimizer/state.safetensors`: for each trained parameter (its `named_parameters()` name), full fp32 tensors
  `{name}.exp_avg` and `{name}.exp_avg_sq` (AdamW; SGD keeps none), and `{name}.master`, the fp32 master
  weight, where the trainer keeps one beside weights of a lower `model.dtype` (fsdp, deepspeed);
- `optimizer/state.json`: `{"format": 1, "optimizer": ..., "step": N}`, N the optimizer steps taken (AdamW's bias
  correction reads it).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from ..errors import RunError, SpecError

STATE_FILE = "trainer_state.json"
OPTIMIZER_DIR = "optimizer"
OPTIMIZER_TENSORS = "state.safetensors"
OPTIMIZER_META = "state.json"
OPTIMIZER_FORMAT = 1
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
MASTER_KEY = "master"


class Checkpoints:
    def __init__(self, root: Path, keep_last: int, save_optimizer: bool) -> None:
        self.root = root
        self.keep_last = keep_last
        self.save_optimizer = save_optimizer
        self.protected: set[str] = set()
        """Checkpoint names pruning leaves alone (`checkpoint.keep_best`'s, `rlspec.evaluation.best`)."""

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
                    shutil.rmtree(file) if file.is_dir() else file.unlink()
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
        """The completed checkpoints, oldest first by step number (`step_1000000` is newer than `step_999999`)."""
        if not self.root.is_dir():
            return []
        done = [p for p in self.root.glob("step_*") if p.name[5:].isdigit() and (p / STATE_FILE).is_file()]
        return sorted(done, key=lambda p: int(p.name[5:]))

    def remove_leftovers(self) -> None:
        """At the start of a run: remove what a crash in the middle of `save` left behind. A staging folder is
        unfinished work; a replaced checkpoint is dropped once its successor is in place, else put back."""
        if not self.root.is_dir():
            return
        for staging in self.root.glob(".staging_step_*"):
            shutil.rmtree(staging, ignore_errors=True)
        for old in self.root.glob(".replaced_step_*"):
            final = self.root / old.name.removeprefix(".replaced_")
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.rename(final)

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for old in self.completed()[:-self.keep_last]:
            if old.name not in self.protected:
                shutil.rmtree(old)


def step_of(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / STATE_FILE).read_text())["step"])


def check_resumable(checkpoint: Path, model_spec) -> int:
    """The step `checkpoint` was saved after; refuses (`SpecError` on `--resume`) a checkpoint whose state
    file is unreadable or whose weights are corrupt or belong to another model than `model_spec`'s."""
    from ..models.checks import check_weights, read_config
    from ..models.factory import preset_config

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


def resume_warnings(checkpoint: Path, plan, caps) -> list[str]:
    """How resuming `checkpoint` under `plan` (on a backend with `caps`) makes the next steps compute other than
    the uninterrupted run would: optimizer state not saved (`checkpoint.save_optimizer=false`: AdamW starts again
    from zero moments and step 0), or fp32 master weights the resuming trainer does not keep. Empty when exact."""
    found = []
    saved = [checkpoint / OPTIMIZER_DIR / OPTIMIZER_META, checkpoint / "optimizer.pt", checkpoint / "optimizer_dcp"]
    if plan.spec.algorithm.optimizer != "sgd" and not any(path.exists() for path in saved):
        found.append(f"checkpoint {checkpoint.name} holds no optimizer state (it was saved with "
                     "checkpoint.save_optimizer=false): the optimizer starts again from zero moments and step 0, so "
                     "the resumed steps differ from an uninterrupted run's (keep checkpoint.save_optimizer=true "
                     "for exact resumes)")
    tensors = checkpoint / OPTIMIZER_DIR / OPTIMIZER_TENSORS
    if tensors.is_file() and not caps.keeps_master_weights:
        from safetensors import safe_open

        with safe_open(str(tensors), framework="pt") as f:
            masters = sum(1 for key in f.keys() if key.endswith(f".{MASTER_KEY}"))
        if masters:
            found.append(f"checkpoint {checkpoint.name} holds fp32 master weights for {masters} parameters, which the "
                         f"{plan.backend} backend does not keep: it resumes from the {plan.spec.model.dtype} weights "
                         "and steps them directly, so the resumed steps differ from an uninterrupted run's (resume "
                         "with a backend that keeps master weights: "
                         "--backend fsdp or deepspeed)")
    return found


def write_optimizer_state(path: Path, tensors: dict, optimizer: str, step: int) -> None:
    """Write the portable optimizer state (see the module docstring) into checkpoint directory `path`."""
    from safetensors.torch import save_file

    folder = path / OPTIMIZER_DIR
    folder.mkdir(exist_ok=True)
    save_file({name: t.detach().float().contiguous().cpu() for name, t in tensors.items()}, str(folder / OPTIMIZER_TENSORS))
    (folder / OPTIMIZER_META).write_text(json.dumps({"format": OPTIMIZER_FORMAT, "optimizer": optimizer, "step": int(step)}))


def read_optimizer_state(path: Path) -> tuple[dict, int] | None:
    """(tensors by `{name}.{key}`, step) of the portable optimizer state in `path`; None when it holds none."""
    meta = path / OPTIMIZER_DIR / OPTIMIZER_META
    if not meta.is_file():
        return None
    from safetensors.torch import load_file

    info = json.loads(meta.read_text())
    if info.get("format") != OPTIMIZER_FORMAT:
        raise RunError(f"{meta}: optimizer state format {info.get('format')!r}, this rlspec reads {OPTIMIZER_FORMAT}")
    return load_file(str(path / OPTIMIZER_DIR / OPTIMIZER_TENSORS)), int(info["step"])


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
