"""Errors the CLI maps to exit codes: `SpecError` (bad input) -> 2, `RunError` (failure while running) -> 1."""

from __future__ import annotations

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


__all__ = ["RunError", "SpecError"]
