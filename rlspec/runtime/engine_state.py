"""The rollout side of a checkpoint: what the engine held and what was already sampled when the trainer saved.

A resume is exact only if the engine samples the next batches with the weights it would have had. That is the
trainer's when every step ends with a push; it is not when the engine lags:
- `sync.every_n_steps` = N > 1: after step s the engine holds the weights of the last push, version
  (s + 1) - (s + 1) % N, not the trainer's s + 1;
- `rollout.mode=async`: the pool holds batches sampled ahead by older weights (`rlspec.core.async_loop`), and
  the engine may hold an older version than the trainer.

Then the checkpoint gets the folder `engine/`: `state.json` (`{"format": 1, "version": v, "pending": [...]}`),
the engine's weights in `model.safetensors` when v differs from the trainer's version, and each pooled batch
not yet trained in `batch_<step>.safetensors` (with its policy version and reward counters in `state.json`). A
resume loads those weights into the engine in place of a push of the trainer's, and puts the batches back in
the pool: the run goes on as if it had never stopped. Without the folder (the engine held the trainer's
weights, nothing pending) a resume pushes the trainer's weights, as a run that just synced would have.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import RunError
from ..core.batch import TrainBatch

ENGINE_DIR = "engine"
ENGINE_FORMAT = 1


@dataclass
class Pending:
    """A batch the rollout loop sampled ahead, not trained yet."""

    step: int
    batch: TrainBatch
    policy_version: int
    counters: dict[str, float]


@dataclass
class EngineState:
    """The engine's weight version, as the loops keep it, and (async) how to read the pool's batches."""

    version: int
    """Trainer steps behind the weights the engine holds (its last push)."""
    pending: Callable[[], list[Pending]] = field(default=lambda: [])
    lags: bool = True
    """False where the engine shares the trainer's weights (`sync.method=shared`): it never lags."""


class RunSaver:
    """What `Checkpoints.save` calls: the backend's checkpoint, then the engine's state beside it."""

    def __init__(self, backend, engine, state: EngineState) -> None:
        self.backend, self.engine, self.state = backend, engine, state
        self.steps_done = 0

    def at(self, step: int) -> "RunSaver":
        self.steps_done = step + 1
        return self

    def save(self, path: Path) -> None:
        self.backend.save(path)
        if self.state.lags:
            write_engine_state(Path(path), self.engine, self.state.version, self.steps_done, self.state.pending())


def write_engine_state(path: Path, engine, version: int, steps_done: int, pending: list[Pending]) -> None:
    """Write `engine/` into checkpoint `path` when the engine lags the trainer's `steps_done` or batches are pending."""
    if version == steps_done and not pending:
        return
    from safetensors.torch import save_file

    folder = path / ENGINE_DIR
    folder.mkdir()
    if version != steps_done:
        save_file(_distinct(engine.named_weights()), str(folder / "model.safetensors"))
    for item in pending:
        tensors = {f.name: value.detach().cpu().contiguous().clone()
                   for f in dataclasses.fields(item.batch) if (value := getattr(item.batch, f.name)) is not None}
        save_file(tensors, str(folder / f"batch_{item.step:06d}.safetensors"))
    meta = {"format": ENGINE_FORMAT, "version": version, "weights": version != steps_done,
            "pending": [{"step": p.step, "policy_version": p.policy_version, "counters": p.counters} for p in pending]}
    (folder / "state.json").write_text(json.dumps(meta, indent=2))


def read_engine_state(checkpoint: Path | None) -> tuple[int, dict | None, list[Pending]] | None:
    """(version, the engine's weights or None when they are the trainer's, pending batches) of `checkpoint`;
    None when it has no `engine/` (the engine held the trainer's weights, nothing was pending)."""
    folder = None if checkpoint is None else checkpoint / ENGINE_DIR
    if folder is None or not (folder / "state.json").is_file():
        return None
    from safetensors.torch import load_file

    meta = json.loads((folder / "state.json").read_text())
    if meta.get("format") != ENGINE_FORMAT:
        raise RunError(f"{folder}: engine state format {meta.get('format')!r}, this rlspec reads {ENGINE_FORMAT}")
    weights = load_file(str(folder / "model.safetensors")) if meta["weights"] else None
    pending = [Pending(p["step"], TrainBatch(**load_file(str(folder / f"batch_{p['step']:06d}.safetensors"))),
                       p["policy_version"], p["counters"]) for p in meta["pending"]]
    return int(meta["version"]), weights, pending


def _distinct(named) -> dict[str, torch.Tensor]:
    """CPU copies by name, a tensor stored under several names (tied) once: safetensors refuses shared storage,
    and loading it under one name fills the others."""
    out, seen = {}, set()
    for name, tensor in named:
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            out[name] = tensor.detach().cpu().contiguous().clone()
    return out
