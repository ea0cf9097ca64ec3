"""What watches a run while the loop runs: SIGTERM, non-finite numbers, stalls, and the run's own log.

- SIGTERM (a scheduler's preemption notice; Slurm and Kubernetes send it to every process of the run at
  once) or SIGINT (Ctrl-C): the run checkpoints its last completed step and ends with `Stopped` (exit 143 =
  128 + SIGTERM, 130 for SIGINT, so scripts do not take it for a finished run); `rlspec run ... --resume`
  continues from that checkpoint. A step still sampling (no optimizer step taken yet, synchronous loop) is
  abandoned at once and the previous step is checkpointed; a step already updating finishes first. The Ray
  actors defer the signal (`rlspec.runtime.stall.defer_termination`) and a local Ray cluster's processes
  start with it blocked (`rlspec.cluster.ray_utils.start_ray`), so that they live to write their part. All of
  this must end within `hardware.preempt_grace_s`: past it the process exits 128 + signal without that checkpoint (the
  previous one stays the latest, a half-written one is never published). A second signal stops at once.
- A non-finite loss, grad norm or KL stops the run at that step with `RunError` naming the step, before
  its weights are checkpointed: the previous checkpoint stays the latest.
- A stall (`rlspec.runtime.stall`): after the dump, `stall_action=fail` interrupts the main thread (SIGUSR1) so
  the run unwinds as for any failure (actors killed first, then the transport closed, exit 1); a main thread
  stuck inside C code cannot take the signal, or a teardown that waits on a stuck actor would never end, so the
  process then exits 1 on its own `HARD_EXIT_AFTER_S` after the stall (a timer; a `faulthandler` backstop that
  needs no interpreter lock `GRACE_BACKSTOP_S` later), unless the run has torn down by then (`disarm`).
- `RunLog`: OUT/run.log receives everything the driver prints, including the actors' stdout/stderr that
  Ray forwards to the driver (exceptions in worker threads, crash dumps: otherwise only in Ray's session
  logs), and the account of the failure that ended the run.
"""

from __future__ import annotations

import faulthandler
import io
import math
import os
import re
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import RunError, Stopped
from ..spec import RunPlan
from .stall import STOP_SIGNALS, StallWatchdog

GRACE_BACKSTOP_S = 10.0
"""Past `hardware.preempt_grace_s` + this, a process whose exit timer could not run exits 1 (with every stack)."""
HARD_EXIT_AFTER_S = 60.0
"""After a fatal stall, how long the main thread has to unwind before the process exits 1 by itself."""
CHECKED_METRICS = ("loss", "grad_norm", "kl")
RUN_LOG = "run.log"


def check_finite(step: int, row: dict, loss_scaled: bool = False) -> None:
    """Refuse a step whose loss, grad norm or KL is NaN or infinite.

    With fp16 loss scaling (`loss_scaled`) an infinite grad norm is the scaler's overflow signal: the
    update was skipped and the scale lowered, so only the loss and KL count there."""
    keys = [k for k in CHECKED_METRICS if not (loss_scaled and k == "grad_norm")]
    bad = [f"{key}={row[key]}" for key in keys if isinstance(row.get(key), float) and not math.isfinite(row[key])]
    if bad:
        raise RunError(f"step {row.get('step', step)}: non-finite {', '.join(bad)}; stopped before checkpointing "
                       "these weights (the previous checkpoint stays the latest) — lower algorithm.lr or set "
                       "algorithm.max_grad_norm, and check the rewards")


class StepAbandoned(BaseException):
    """Raised in the main thread by a stop signal while the step may still be dropped (`abandonable`): no weight
    has changed in it yet. A BaseException, so that no `except Exception` on the way swallows it."""


class RunMonitor:
    """Context manager around `rlspec.core.loop.train`; the loop calls `step_done` after each step's metrics,
    and marks with `abandonable` the part of a step that a stop signal may cut short."""

    def __init__(self, plan: RunPlan, out_dir: Path, actors: Callable[[], Sequence[tuple[str, Any]]] = lambda: ()) -> None:
        hw = plan.spec.hardware
        self.stop_signal: int | None = None
        self.grace_s = hw.preempt_grace_s
        self._grace: threading.Timer | None = None
        self._abandonable = False
        self._loss_scaled = plan.spec.model.dtype == "float16"
        self._main = threading.current_thread() is threading.main_thread()
        self._previous: dict[int, Any] = {}
        self.stall: RunError | None = None
        """The stall that ended the run (stall_action=fail), once the watchdog fired."""
        self._stall_raised = False
        self._hard_exit: threading.Timer | None = None
        self.watchdog = None
        if hw.stall_timeout_s > 0:
            self.watchdog = StallWatchdog(hw.stall_timeout_s, out_dir, actors, self._on_stall,
                                          keep_watching=hw.stall_action == "warn", cuda=plan.placement.device == "cuda",
                                          first_step_s=hw.stall_first_step_s)

    def __enter__(self) -> "RunMonitor":
        if self._main:  # Python delivers signals to the main thread only; elsewhere, no signal handling
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_stop_signal)
            self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._raise_stall)
        if self.watchdog is not None:
            self.watchdog.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.stall is None:  # after a stall the hard exit covers the teardown too, until `disarm`
            self.disarm()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self.stall is not None and exc is not None and exc is not self.stall:
            # The interrupt can land inside a C extension, which reports it as its own error (Ray's
            # `wait` raises SystemError): the run still ended because of the stall.
            raise self.stall from exc

    def disarm(self) -> None:
        """Cancel the exits armed by a stop signal or a stall (once the run has torn down: idempotent)."""
        for timer in (self._hard_exit, self._grace):
            if timer is not None:
                timer.cancel()
        if self._grace is not None or self.stall is not None:
            faulthandler.cancel_dump_traceback_later()

    def step_done(self, step: int, row: dict) -> bool:
        """Step `step` finished with metrics `row`: raise on non-finite numbers; return whether to stop now."""
        check_finite(step, row, self._loss_scaled)
        if self.watchdog is not None:
            self.watchdog.beat(step)
        return self.stop_signal is not None

    def stopped(self, step: int | None, checkpoint: Path | None) -> Stopped:
        return Stopped(self.stop_signal or signal.SIGTERM, step, checkpoint)

    @contextmanager
    def abandonable(self):
        """The part of a step with no optimizer step in it (sampling, scoring): a stop signal inside it, or one
        that came before it, raises `StepAbandoned` instead of waiting for the step to end."""
        if self.stop_signal is not None:
            raise StepAbandoned()
        self._abandonable = True
        try:
            yield
        finally:
            self._abandonable = False

    # --- signals -----------------------------------------------------------------------------------------

    def _on_stop_signal(self, signum: int, frame) -> None:
        if self.stop_signal is not None:
            raise Stopped(signum, None, None)
        self.stop_signal = signum
        self._grace = threading.Timer(self.grace_s, _grace_exit, (signum, self.grace_s))
        self._grace.daemon = True
        self._grace.start()
        # The timer needs the GIL; a main thread stuck in C code holding it would keep it from firing. This
        # backstop needs nothing: it prints every thread's stack and exits 1.
        try:
            faulthandler.dump_traceback_later(self.grace_s + GRACE_BACKSTOP_S, exit=True, file=sys.__stderr__)
        except (AttributeError, ValueError, io.UnsupportedOperation):  # no stderr file descriptor: no backstop
            pass
        now = self._abandonable
        what = ("abandoning this step (no update yet) and checkpointing the last completed one" if now
                else "checkpointing this step once it completes")
        print(f"rlspec: {signal.Signals(signum).name} received: {what} within hardware.preempt_grace_s="
              f"{self.grace_s:g} (send it again to stop at once)", file=sys.stderr, flush=True)
        if now:
            self._abandonable = False
            raise StepAbandoned()

    def _on_stall(self, message: str) -> None:
        print(f"rlspec: {message}", file=sys.stderr, flush=True)
        if self.watchdog is not None and self.watchdog.keep_watching:
            return
        self.stall = RunError(message)
        if self._main:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        self._hard_exit = threading.Timer(HARD_EXIT_AFTER_S, _hard_exit, (message,))
        self._hard_exit.daemon = True
        self._hard_exit.start()
        try:  # as for a stop signal: a backstop that needs no GIL, every thread's stack then exit 1
            faulthandler.dump_traceback_later(HARD_EXIT_AFTER_S + GRACE_BACKSTOP_S, exit=True, file=sys.__stderr__)
        except (AttributeError, ValueError, io.UnsupportedOperation):  # no stderr file descriptor: no backstop
            pass

    def _raise_stall(self, signum: int, frame) -> None:
        if self.stall is not None and not self._stall_raised:
            self._stall_raised = True
            raise self.stall


def _grace_exit(signum: int, grace_s: float) -> None:
    print(f"rlspec: {signal.Signals(signum).name}: no checkpoint completed within hardware.preempt_grace_s={grace_s:g}; "
          "exiting without one (the latest checkpoint is unchanged; continue with --resume)", file=sys.stderr, flush=True)
    os._exit(128 + int(signum))


def _hard_exit(message: str) -> None:
    print(f"rlspec: run failed: {message}\nrlspec: the main thread did not unwind within {HARD_EXIT_AFTER_S:.0f} s "
          "(blocked inside C code); exiting", file=sys.stderr, flush=True)
    os._exit(1)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
"""Terminal colour codes (Ray colours its actor prefixes): kept on the terminal, dropped from the file."""


class _Tee:
    """A text stream that also appends to the run log (Ray's forwarding thread writes here too)."""

    def __init__(self, stream, log, lock: threading.Lock) -> None:
        self._stream, self._log, self._lock = stream, log, lock

    def write(self, text: str) -> int:
        with self._lock:
            if not self._log.closed:
                self._log.write(_ANSI.sub("", text))
                self._log.flush()
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class RunLog:
    """Copy the driver's stdout/stderr into `path` while the run is on; record how it ended."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> "RunLog":
        self._file = self.path.open("a", buffering=1)
        lock = threading.Lock()
        self._saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(sys.stdout, self._file, lock), _Tee(sys.stderr, self._file, lock)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        sys.stdout, sys.stderr = self._saved
        if exc is not None:
            if isinstance(exc, (RunError, Stopped)):
                self._file.write(f"rlspec: {'stopped' if isinstance(exc, Stopped) else 'run failed'}: {exc}\n")
            else:
                self._file.write("".join(traceback.format_exception(exc_type, exc, tb)))
        self._file.close()
