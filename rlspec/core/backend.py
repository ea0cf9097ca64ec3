"""The `Backend` protocol and the registry of backends by name (entry point group `rlspec.backends`).

A backend owns the trainer ranks (and, for multi-process backends, places the rollout engines). It
never moves weights itself: `weight_source()` runs a `sync` transport's sender half next to the full
weights (`export_weights` brings them to the driver), and the transport moves them. The step
order is `rlspec.core.loop.train`, shared by every backend.
"""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Iterator, Protocol, runtime_checkable

from ..spec import BackendCaps, RunPlan, SpecError

if TYPE_CHECKING:  # the registry below serves `rlspec plan`, which never imports torch
    from torch import Tensor

    from ..rollout.base import RolloutEngine
    from .batch import TrainBatch
    from .grpo import LossNorm
    from .weights import WeightSource

ENTRY_POINT_GROUP = "rlspec.backends"
CAPS_ENTRY_POINT_GROUP = "rlspec.backend_caps"
"""A backend may also register its `BackendCaps` object here (same name), in a module that imports nothing heavy:
then `all_caps()`, and with it `rlspec plan`, reads the caps without importing the backend's module."""


@runtime_checkable
class Backend(Protocol):
    """One trainer implementation. Methods run on the driver; a backend fans out to its ranks."""

    caps: ClassVar[BackendCaps]

    def setup(self, plan: RunPlan) -> None:
        """Build model(s), optimizer and rollout engine(s) from the plan. Raises `RunError` on failure."""

    def rollout_engine(self) -> RolloutEngine:
        """The engine (or group of engines) that samples completions for this backend's placement."""

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        """[N, L] token log-probs of the current (or the reference) policy, no gradient."""

    def forward_backward(self, batch: TrainBatch, norm: LossNorm) -> dict[str, float]:
        """Accumulate gradients of the shared GRPO loss over `batch` (sharded over ranks, split into
        micro-batches); return statistic sums (`rlspec.core.policy.STAT_KEYS`) over the whole batch, as a mapping
        that may read them from the device only when first accessed (`rlspec.core.policy.DeviceSums`): read
        them after `optimizer_step`."""

    def optimizer_step(self) -> float:
        """Clip (if configured), step, zero gradients; return the global grad norm before clipping."""

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full (unsharded) policy weights by Hugging Face name, one tensor at a time, on the driver."""

    def weight_source(self) -> WeightSource:
        """Where a transport's sender half runs next to the full weights (`rlspec.core.weights.WeightSource`):
        in-process for a single-process trainer, inside the ranks for a sharded one."""

    def save(self, path: Path) -> None:
        """Write a checkpoint directory: `save_pretrained` safetensors (+ tokenizer) and optimizer state."""

    def load(self, path: Path) -> None:
        """Restore weights and optimizer state from a directory written by `save`."""

    def shutdown(self) -> None:
        """Release processes, actors and process groups. Safe to call twice."""

    # Optional, looked up with getattr (a backend without it loses nothing):
    # `prepare_update() -> None`: called by the synchronous loop just before the engines sample a step's batch
    # (by the asynchronous one before it waits for the next batch).
    # A backend whose trainer processes sit idle while the engines sample starts there, without waiting, the
    # work its next update can do ahead (fsdp: gathering the parameters that stay gathered through the update).


def _entry_points(group: str = ENTRY_POINT_GROUP) -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=group)}


def backend_names() -> list[str]:
    return sorted(_entry_points())


def backend_class(name: str) -> type:
    """The backend class registered under `name` (imports its module; heavy imports stay lazy)."""
    eps = _entry_points()
    if name not in eps:
        raise SpecError("backend", f"{name!r} is not a registered backend",
                        f"use one of: {', '.join(sorted(eps))} (backends register under the entry point group {ENTRY_POINT_GROUP})")
    return eps[name].load()  # type: ignore[attr-defined]


def all_caps() -> dict[str, BackendCaps]:
    """Capabilities of every registered backend, for the compiler.

    A backend whose module fails to import is left out with a warning, so one broken third-party
    package does not stop plans for the others.
    """
    caps, declared = {}, _entry_points(CAPS_ENTRY_POINT_GROUP)
    for name in backend_names():
        try:
            caps[name] = declared[name].load() if name in declared else backend_class(name).caps  # type: ignore[attr-defined]
        except Exception as err:  # noqa: BLE001 - report and carry on
            warnings.warn(f"backend {name!r} could not be loaded and is skipped: {err!r}", stacklevel=2)
    return caps


def create_backend(name: str) -> Backend:
    return backend_class(name)()


def weight_source_of(backend: Backend) -> WeightSource:
    """`backend.weight_source()`, or its `export_weights` run in this process for a backend without one."""
    from .weights import LocalWeights

    make = getattr(backend, "weight_source", None)
    return make() if make is not None else LocalWeights(backend.export_weights)
