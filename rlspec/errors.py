"""Errors the CLI maps to exit codes: `SpecError` (bad input) -> 2, `RunError` (failure while running) -> 1."""

from __future__ import annotations

import signal
from pathlib import Path

from .spec.errors import SpecError


class RunError(RuntimeError):
    """A failure during the run; `worker_traceback` carries the failing worker's traceback when remote."""

    def __init__(self, message: str, worker_traceback: str | None = None) -> None:
        super().__init__(message)
        self.worker_traceback = worker_traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.worker_traceback:
            text += "\n--- worker traceback ---\n" + self.worker_traceback.rstrip()
        return text


class Stopped(Exception):
    """The run stopped on a signal (e.g. a scheduler's SIGTERM), after checkpointing `step` when it could.

    The CLI exits with `exit_code` (128 + the signal number, the shell's convention for "terminated").
    """

    def __init__(self, signum: int, step: int | None, checkpoint: Path | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + int(signum)
        name = signal.Signals(signum).name
        if checkpoint is not None:
            text = f"{name}: stopped after step {step}; checkpoint {checkpoint} — continue with --resume"
        elif step is not None:
            text = f"{name}: stopped before the first step completed; nothing to checkpoint — start the run again"
        else:
            text = f"{name} again: stopped at once, without a checkpoint of the current step"
        super().__init__(text)


__all__ = ["RunError", "SpecError", "Stopped"]
