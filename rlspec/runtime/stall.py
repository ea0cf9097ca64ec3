"""The stall detector: when no step completes within `hardware.stall_timeout_s`, look before calling it a deadlock.

A hung distributed step usually shows on the driver only as a call that never returns, while one rank
is stuck somewhere and its peers wait for it in a collective. The watchdog thread here writes, into
`OUT/stall/<n>/`, the Python stacks of every driver thread (`driver.txt`), of every Ray actor
(`<actor label>.txt`, e.g. `trainer_rank_1.txt`) and, on CUDA, `nvidia-smi` (`gpu.txt`; each actor also
reports its own CUDA memory), says where on stderr, and then stops the run with exit 1 — or, with
`hardware.stall_action=warn`, keeps waiting and dumps again after another timeout.

What a Ray actor class needs for its stacks to be dumped (the actor's own thread is the one blocked, so
the dump must not need it):
  1. inherit `StackReporter` (one method, `stacks()`, that formats `sys._current_frames()` of all its
     threads), and
  2. be made remote with `remote_class(cls)` instead of `ray.remote(cls)`: that adds a one-thread
     concurrency group `STACKS_GROUP`, so `stacks()` runs on its own thread while the actor's methods
     keep their usual one-at-a-time thread.
The backend then lists its actors for the dump with a method `actors() -> [(label, handle), ...]`.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

STACKS_GROUP = "rlspec_stacks"
"""The Ray concurrency group that runs `StackReporter.stacks` beside an actor's blocked thread."""
ACTOR_ANSWER_S = 15.0
"""How long the dump waits for an actor's stacks (a process frozen while holding the GIL never answers)."""


def format_stacks(title: str = "") -> str:
    """Every thread's Python stack in this process, the way a traceback reads (innermost call last)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    lines = [f"{title or 'process'}: pid {os.getpid()} on {socket.gethostname()}, {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue  # the thread writing this dump
        lines.append(f"\n--- thread {names.get(ident, '?')} ({ident}) ---")
        lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
    return "\n".join(lines) + "\n"


def cuda_report() -> str:
    """This process's CUDA memory (and utilisation where pynvml is installed); empty without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return ""
        device = torch.cuda.current_device()
        text = (f"cuda:{device} {torch.cuda.get_device_name(device)}: allocated "
                f"{torch.cuda.memory_allocated(device) / 2**30:.2f} GiB, reserved {torch.cuda.memory_reserved(device) / 2**30:.2f} GiB")
        try:
            text += f", utilisation {torch.cuda.utilization(device)} %"
        except Exception:  # noqa: BLE001 - needs pynvml
            pass
        return text + "\n"
    except Exception as err:  # noqa: BLE001 - a report, never a new failure
        return f"(CUDA state unavailable: {err!r})\n"


def nvidia_smi() -> str:
    """`nvidia-smi` on this node: utilisation, memory and the processes on each GPU."""
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=index,name,utilization.gpu,memory.used,memory.total",
                                "--format=csv"], capture_output=True, text=True, timeout=20)
        procs = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv"],
                               capture_output=True, text=True, timeout=20)
        return query.stdout + query.stderr + "\n" + procs.stdout + procs.stderr
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"nvidia-smi unavailable: {err!r}\n"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""A scheduler's preemption notice and Ctrl-C: the driver checkpoints on them (`rlspec.runtime.monitor`)."""


class StackReporter:
    """Mixin for Ray actor classes: `stacks()` answers from its own thread (see the module docstring). Built inside
    a Ray worker, the actor also defers the stop signals (`defer_termination`) and dumps every thread's Python
    stack when it dies of a fatal signal (`report_fatal_signals`)."""

    def __new__(cls, *args, **kwargs):
        # Here rather than in each actor's __init__: every rlspec actor class inherits this, and its
        # construction is the one call Ray makes on the actor process's main thread.
        if _in_ray_worker():
            defer_termination()
            report_fatal_signals()
        return super().__new__(cls)

    def stacks(self) -> str:
        return format_stacks(type(self).__name__) + cuda_report()


def defer_termination() -> None:
    """Record SIGTERM and SIGINT instead of dying of them (a Ray worker's default), so that the driver, which
    gets the same signal from the scheduler, can still have this actor save its part of a checkpoint; the
    driver's exit ends the actor. Only from the main thread (Python's rule for signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in STOP_SIGNALS:
        signal.signal(signum, _note_deferred)


def report_fatal_signals() -> None:
    """On SIGSEGV, SIGABRT, SIGFPE, SIGBUS or SIGILL, write the Python stack of every thread to stderr (which
    Ray forwards to the driver) before the process dies.

    Ray's worker enables this for the crashing thread only. An actor with concurrency groups (the stacks group
    here) runs its methods on a pool thread, not the main one, and a crash inside a native library often happens
    on one of the library's own threads (a collective's worker, an OpenMP thread), which has no Python stack: the
    one-thread dump is then empty. The method that was running is the first thing a crash report needs."""
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError):  # no stderr, or one without a file descriptor:
        pass  # keep Ray's setting


def _note_deferred(signum: int, frame) -> None:
    print(f"rlspec: {signal.Signals(signum).name} deferred in actor pid {os.getpid()}: the driver checkpoints and "
          "ends the run", file=sys.stderr, flush=True)


def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except Exception:  # noqa: BLE001 - no ray, or an older layout: not an actor of ours
        return False


def remote_class(cls: type, **ray_options: Any):
    """`ray.remote(cls)` with the extra one-thread concurrency group that `StackReporter.stacks` runs in."""
    import ray

    return ray.remote(concurrency_groups={STACKS_GROUP: 1}, **ray_options)(cls)


def actor_stacks(actors: Sequence[tuple[str, Any]], timeout_s: float = ACTOR_ANSWER_S) -> dict[str, str]:
    """`stacks()` of every actor by label, all asked at once; a silent or dead actor is said to be so."""
    import ray

    refs = {}
    for label, handle in actors:
        try:
            refs[label] = handle.stacks.options(concurrency_group=STACKS_GROUP).remote()
        except Exception as err:  # noqa: BLE001 - e.g. an actor class without StackReporter
            refs[label] = err
    asked = [r for r in refs.values() if not isinstance(r, Exception)]
    if asked:
        ray.wait(asked, num_returns=len(asked), timeout=timeout_s)
    out = {}
    for label, ref in refs.items():
        if isinstance(ref, Exception):
            out[label] = f"cannot ask {label} for its stacks: {ref!r}\n"
            continue
        try:
            out[label] = ray.get(ref, timeout=0.1)
        except ray.exceptions.GetTimeoutError:
            handle = dict(actors)[label]
            state = process_state(handle)
            if state is not None and state[1] in "Tt":
                out[label] = (f"{SILENT}{STOPPED}{label} did not answer within {timeout_s:.0f} s: its process (pid "
                              f"{state[0]}) is stopped (state {state[1]}: SIGSTOP or a debugger)\n")
            else:
                out[label] = (f"{SILENT}{label} did not answer within {timeout_s:.0f} s: its process is stopped, "
                              "frozen while holding the GIL (a C extension that does not release it) or gone\n")
        except Exception as err:  # noqa: BLE001 - a dead actor: say how it died
            out[label] = f"{label} could not report: {err}\n"
    return out


SILENT = "SILENT: "
"""How the dump of an actor that did not answer begins (the stall message names those actors)."""
STOPPED = "STOPPED: "
"""After `SILENT`, for an actor whose process on this node is seen stopped: the one to name when its peers, blocked in
a collective, cannot answer either (on CUDA they may wait holding the GIL)."""


def process_state(handle) -> tuple[int, str] | None:
    """(pid, state letter from /proc) of an actor's process when it runs on this node, else None."""
    try:
        import ray
        from ray._private import state as ray_state  # the GCS actor table: the actor's pid and node

        info = ray_state.actors(actor_id=handle._actor_id.hex())
        if info["Address"]["NodeID"] != ray.get_runtime_context().get_node_id():
            return None
        with open(f"/proc/{info['Pid']}/stat") as f:
            return int(info["Pid"]), f.read().rsplit(")", 1)[1].split()[0]
    except Exception:  # noqa: BLE001 - another Ray layout, another node, a process gone: nothing to add
        return None


def _file_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") + ".txt"


class StallWatchdog:
    """A daemon thread that fires when `beat` is not called for `timeout_s` seconds (before the first beat: for
    `first_step_s`, where that is longer: the first step warms up).

    On firing it writes the dump (see the module docstring) and calls `on_stall(message)`; with
    `keep_watching` it re-arms and fires again after another `timeout_s` without a beat.
    """

    def __init__(self, timeout_s: float, out_dir: Path, actors: Callable[[], Sequence[tuple[str, Any]]],
                 on_stall: Callable[[str], None], keep_watching: bool = False, cuda: bool = False,
                 first_step_s: float = 0.0) -> None:
        self.timeout_s = timeout_s
        self.first_step_s = max(first_step_s, timeout_s)
        self.out_dir = out_dir
        self.actors = actors
        self.on_stall = on_stall
        self.keep_watching = keep_watching
        self.cuda = cuda
        self.last_step: int | None = None
        self.dumps: list[Path] = []
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rlspec-stall-watchdog", daemon=True)

    def start(self) -> "StallWatchdog":
        self._last_beat = time.monotonic()
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """Step `step` completed."""
        self.last_step = step
        self._last_beat = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.is_set():
            first = self.last_step is None
            window = self.first_step_s if first else self.timeout_s
            left = self._last_beat + window - time.monotonic()
            if left > 0:
                self._stop.wait(min(left, 1.0))
                continue
            waited = time.monotonic() - self._last_beat
            where, silent = self.dump(waited)
            after = "the start of the loop" if first else f"step {self.last_step}"
            key = (f"hardware.stall_first_step_s={self.first_step_s:g}, the first step's window" if first
                   and self.first_step_s > self.timeout_s else f"hardware.stall_timeout_s={self.timeout_s:g}")
            # A rank stopped or frozen mid-step leaves its peers waiting in a collective, which answer for their
            # stacks; the one that cannot answer is the one to name.
            culprit = (f"; {', '.join(silent)} did not answer (stopped, frozen or gone: the likely cause, its peers "
                       "wait for it)") if silent else ""
            self.on_stall(f"stalled: no step completed for {waited:.0f} s after {after} "
                          f"({key}){culprit}; stacks of the driver and every "
                          f"actor{' and GPU state' if self.cuda else ''} in {where}")
            if not self.keep_watching:
                return
            self._last_beat = time.monotonic()

    def dump(self, waited_s: float) -> tuple[Path, list[str]]:
        """Write the stacks (and GPU state) into a new `OUT/stall/<n>/`; return that directory and the labels of the
        actors that did not answer (of those seen stopped, if any were)."""
        folder = self.out_dir / "stall" / str(len(self.dumps) + 1)
        folder.mkdir(parents=True, exist_ok=True)
        self.dumps.append(folder)
        after = "loop start" if self.last_step is None else f"step {self.last_step}"
        (folder / "driver.txt").write_text(format_stacks(f"driver, {waited_s:.0f} s since {after}"))
        try:
            actors = list(self.actors())
        except Exception as err:  # noqa: BLE001 - the dump must not fail on a half-torn-down backend
            actors = []
            (folder / "actors_error.txt").write_text(f"could not list the backend's actors: {err!r}\n")
        silent, stopped = [], []
        for label, text in actor_stacks(actors).items() if actors else ():
            (folder / _file_name(label)).write_text(text)
            if text.startswith(SILENT):
                silent.append(label)
            if text.startswith(SILENT + STOPPED):
                stopped.append(label)
        if self.cuda:
            (folder / "gpu.txt").write_text(nvidia_smi())
        return folder, stopped or silent
