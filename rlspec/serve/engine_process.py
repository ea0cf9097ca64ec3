"""`rlspec serve`'s engine in a process of its own (`rlspec serve --engine-process on`, the command's default: see
`process.ENGINE_PROCESS`).

In one process the HTTP side (the event loop: requests arriving, chunks going out, tokenizing) and the engine
thread (admissions, decode runs) take turns at the interpreter lock. Here they run in two processes joined by a
pipe; measured with the packed prefill (docs/serving_concurrency.md), this led at 64 and 256 streams on GPUs:

    HTTP process (the port, every route)            engine process (the engine, `Scheduler`, `EngineHost`)
      a request's rows  ---- ("rows", id, ...) --->   queued, admitted, decoded in the one batch
      a client gone     ---- ("cancel", id) ----->    its rows leave at the next step
                        ---- ("abort", call id) -->   a request that runs alone stops at its next token
      bridge, label,    ---- ("call", id, ...) --->   run on the engine thread as in one process
      state (/health)   <--- ("reply", id, ...) ---
      streams, replies  <--- ("deltas", [...]) ----   every row's new tokens of one decode run, one message

The engine process sends each decode run's new tokens for every request in flight as one message; the HTTP
process applies them on its event loop. Each side writes the pipe from a thread of its own (`PipeWriter`): neither
the engine thread nor the event loop waits for the other process to read (a decode run's deltas for 256 rows are
~40 KB, most of a pipe's buffer), and messages queued meanwhile go as one `batch`. What a request samples, the
order of its rows, its weight version and every bridge operation are the engine process's, exactly as in one
process (`scheduler.py`); the bound of queued rows (`--max-queued-rows`, 429) is kept by the HTTP process, which
counts a request's rows until the engine reports them admitted. A bridge message's body goes through the pipe as it
came (no second copy of its tensors).

Ends: the engine process ends at a `("stop",)` message (the server is stopping) or when the pipe closes (the HTTP
process exited or was killed); when the engine process
dies, the requests in flight fail and the HTTP process is told (`on_exit`: `rlspec serve` shuts its server down and
exits 1 naming the engine process).
The engine process ignores SIGINT (a terminal's Ctrl-C reaches both; the HTTP process's shutdown ends it).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Callable

from ..errors import RunError, SpecError
from .live import Abort, RowQueue, Submission

STATE_TIMEOUT_S = 30.0
"""How long a state query (`/health`, the weight version) waits for the engine process's answer."""
STOP_WAIT_S = 2.0
"""How long a stopping server waits for its engine process to exit (it exits at the stop message) before killing it."""


# --- errors across the pipe ---------------------------------------------------------------------------------
def _portable(err: BaseException) -> tuple:
    """An exception as plain data: the HTTP process raises the same kind (bad input stays exit 2)."""
    if isinstance(err, SpecError):
        return ("spec", err.where, err.problem, err.fix)
    return ("run", f"{type(err).__name__}: {err}", traceback.format_exc() if err.__traceback__ else None)


def _raise_portable(data: tuple) -> BaseException:
    if data[0] == "spec":
        return SpecError(*data[1:])
    return RunError(data[1], data[2])


class PipeWriter:
    """Writes one end of the pipe from a thread of its own, in the order `send` was called: the caller never waits
    for the other process to read. Messages sent while a write is under way go as one `("batch", [...])` (one
    pickle, one write), and wake the thread once (a wake-up is a thread switch: one per request was most of what
    sending cost the event loop); a message with a body (a bridge call's bytes) is written with its body right
    after it."""

    def __init__(self, conn, name: str) -> None:
        self.conn = conn
        self._pending: list = []
        self._lock = threading.Lock()
        self._wake = threading.Semaphore(0)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def send(self, message, body: bytes | None = None) -> None:
        with self._lock:
            self._pending.append((message, body))
            first = len(self._pending) == 1
        if first:
            self._wake.release()

    def close(self) -> None:
        """The thread ends after what was sent before."""
        self.send(None)

    def _run(self) -> None:
        try:
            while True:
                self._wake.acquire()
                with self._lock:
                    items, self._pending = self._pending, []
                batch: list = []
                for message, body in items:
                    if message is None:
                        self._write(batch)
                        return
                    if body is None:
                        batch.append(message)
                        continue
                    self._write(batch)
                    self.conn.send(message)
                    self.conn.send_bytes(body)
                self._write(batch)
        except (OSError, ValueError):  # the pipe closed: the reader on this side sees it too
            return

    def _write(self, batch: list) -> None:
        if len(batch) == 1:
            self.conn.send(batch[0])
        elif batch:
            self.conn.send(("batch", list(batch)))
        batch.clear()


def received(message) -> list:
    """The messages of one read: a `batch`'s, or the one."""
    return message[1] if message[0] == "batch" else [message]


# --- the engine process -------------------------------------------------------------------------------------
class _Forwarded(Submission):
    """A request's rows in the engine process: what they sample is sent back at the end of each step."""

    rid: int = -1
    core: "EngineCore | None" = None
    sent: list[int]
    """Per row: its tokens already sent (-1: its end too)."""

    def notify(self, into: list | None = None) -> None:
        self.core.touched(self)  # sent at the end of the engine thread's turn (`EngineCore.flush`)


class EngineCore:
    """The engine process's side of the pipe: `EngineHost`'s scheduler takes the rows; one reader thread takes the
    HTTP process's messages; the engine thread sends each step's deltas (`flush`)."""

    def __init__(self, conn, host, flush_on_iteration: bool = True) -> None:
        """`flush_on_iteration` false: the caller runs `flush` from the scheduler's `on_iteration` itself (several
        cores over one engine: the agent gateway's processes, `rlspec.agent.processes`)."""
        from .chat import decoder

        self.conn = conn
        self.host = host
        self.decode = decoder(host.engine.tokenizer)
        self.subs: dict[int, _Forwarded] = {}
        """Requests in flight, by the HTTP process's id (a cancel names one)."""
        self.aborts: dict[int, Abort] = {}
        """Requests that run alone (`generate` calls) in flight, by call id (an abort names one)."""
        self._touched: dict[int, _Forwarded] = {}
        self._lock = threading.Lock()
        self.writer = PipeWriter(conn, "rlspec-engine-pipe-writer")
        if flush_on_iteration:
            host.thread.on_iteration = self.flush

    def send(self, message) -> None:
        self.writer.send(message)

    def touched(self, sub: _Forwarded) -> None:
        with self._lock:
            self._touched[sub.rid] = sub

    def flush(self) -> None:
        """On the engine thread, after each step: every touched request's new tokens, one message."""
        with self._lock:
            touched, self._touched = self._touched, {}
        if not touched:
            return
        deltas = []
        for rid, sub in touched.items():
            sent = sub.sent
            with sub.lock:
                rows = []
                for i in range(sub.rows):
                    start = sent[i]
                    if start >= 0 and (len(sub.ids[i]) > start or sub.ended[i]):
                        rows.append((i, sub.ids[i][start:], sub.logprobs[i][start:],
                                     sub.top[i][start:] if sub.top[i] else None, sub.ended[i]))
                        sent[i] = -1 if sub.ended[i] else len(sub.ids[i])
                done = sub.done.is_set()
                error = _portable(sub.error) if sub.error is not None else None
            deltas.append((rid, sub.admitted, sub.version, rows, done, error))
            if done:
                self.subs.pop(rid, None)
        self.send(("deltas", deltas))

    def serve_forever(self) -> None:
        """The engine process's main loop: it exits when the HTTP process stops it or is gone."""
        self.serve()
        os._exit(0)  # nothing in flight is read any more

    def serve(self) -> None:
        """Take the other side's messages until a `stop` or the pipe's close."""
        while True:
            try:
                messages = received(self.conn.recv())
            except (EOFError, OSError):  # the other process is gone
                return
            for message in messages:
                if message[0] == "stop":
                    return
                self._take(message)

    def close(self) -> None:
        """The other side is gone (its process ended) while the engine keeps serving: its rows leave the batch at the
        next step, its jobs stop at their next token, and nothing more is sent."""
        for sub in list(self.subs.values()):
            sub.cancel()
        for abort in list(self.aborts.values()):
            abort.set()
        self.writer.close()

    def _take(self, message) -> None:
        kind = message[0]
        if kind == "rows":
            _, rid, prompt_ids, samplings, stops = message
            sub = _Forwarded(prompt_ids, samplings, stops, self.decode if stops else None)
            sub.rid, sub.core, sub.sent = rid, self, [0] * len(samplings)
            self.subs[rid] = sub
            self.host.thread.submit_rows(sub)
        elif kind == "cancel":
            sub = self.subs.get(message[1])
            if sub is not None:
                sub.cancel()
        elif kind == "abort":
            abort = self.aborts.get(message[1])
            if abort is not None:
                abort.set()
        elif kind == "call":
            _, cid, what, args = message
            if what == "bridge":
                args = (self.conn.recv_bytes(),)
            if what == "state":
                self._reply(cid, lambda: self.host.state())
            else:
                threading.Thread(target=self._reply, args=(cid, self._call(cid, what, args)), daemon=True).start()

    def _call(self, cid: int, what: str, args: tuple) -> Callable[[], Any]:
        from .app import bridge_call

        host = self.host
        if what == "bridge":
            return lambda: asyncio.run(bridge_call(host, *args))
        if what == "label":
            return lambda: asyncio.run(host.label(*args))
        if what == "generate":
            abort = self.aborts[cid] = Abort()

            def generate():
                try:
                    # the host's own call: on the engine thread, or beside it for an engine outside this process
                    # (the agent gateway's view of Ray engines or a rollout server, behind agent processes)
                    return asyncio.run(host.generate_alone(*args, abort=abort))
                finally:
                    self.aborts.pop(cid, None)

            return generate
        raise ValueError(f"unknown engine call {what!r}")

    def _reply(self, cid: int, fn: Callable[[], Any]) -> None:
        try:
            self.send(("reply", cid, True, fn()))
        except BaseException as err:  # noqa: BLE001 - raised again in the HTTP process
            self.send(("reply", cid, False, _portable(err)))


def settle_heap() -> None:
    """Before a server process starts serving: what it built (the model, the tokenizer, the app) moved out of the
    garbage collector's reach (`gc.freeze`), so a full collection under load walks only the requests' objects (in
    the one-process server on an H100, 0.53 s of a 1.17 s burst of 256 streams went to the collector)."""
    import gc

    gc.collect()
    gc.freeze()


def engine_info(host, max_model_len: int | None = None, warmed=None) -> dict:
    """What the other side of the pipe needs to know of `host`'s engine before its first request (`RemoteScheduler`,
    `RemoteHost`)."""
    sampler = getattr(host.engine, "sampler_kind", None)
    return {"pool_reason": host.thread.pool_reason, "row_budget": host.thread.row_budget,
            "context": host.thread.context, "max_model_len": max_model_len, "vocab": host.thread.vocab,
            "sampler": sampler() if sampler else None, "pid": os.getpid(), "warmed": warmed}


def engine_main(conn, build: Callable, plan, engine_index: int, model_name: str, switch_interval: float,
                warm_pool: bool = False, max_model_len: int | None = None) -> None:
    """The engine process: `build(plan, engine_index)` the engine (`process.build_engine`), answer `ready` (or
    `failed`), then serve the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.setswitchinterval(switch_interval)
    try:
        from .app import EngineHost

        if plan.spec.hardware.num_threads:
            import torch

            torch.set_num_threads(plan.spec.hardware.num_threads)
        engine = build(plan, engine_index)
        # the HTTP process keeps the bound; only the bridge's jobs write this engine's weights
        host = EngineHost(engine, model_name, max_queued_rows=sys.maxsize, owns_weights=True,
                          max_model_len=max_model_len)
        info = engine_info(host, max_model_len, host.thread.warm_pool() if warm_pool else None)
    except BaseException as err:  # noqa: BLE001 - the HTTP process raises it (a SpecError stays exit 2)
        conn.send(("failed", _portable(err)))
        return
    conn.send(("ready", info))
    settle_heap()
    EngineCore(conn, host).serve_forever()


# --- the HTTP process ---------------------------------------------------------------------------------------
class _EngineView:
    """What the routes read of the engine in the HTTP process: its tokenizer and rollout settings."""

    def __init__(self, tokenizer, spec, sampler: str | None) -> None:
        self.tokenizer = tokenizer
        self.spec = spec
        self._sampler = sampler

    def sampler_kind(self) -> str | None:
        return self._sampler


class RemoteScheduler(RowQueue):
    """The scheduler as the routes see it, over the pipe: rows go to the engine process, their tokens come back
    (`apply`, on the event loop); the bound of queued rows is kept here."""

    outside = False

    def __init__(self, proc: "EnginePipe", info: dict, max_queued_rows: int) -> None:
        self.proc = proc
        self.pool_reason = info["pool_reason"]
        self.row_budget = info["row_budget"]
        self.context = info["context"]
        self.max_model_len = info["max_model_len"]
        self.vocab = info["vocab"]
        self.max_queued_rows = max_queued_rows
        self.queued_rows = 0
        self.stats = {"refused": 0}
        self._count_lock = threading.Lock()
        self._ids = itertools.count()
        self.subs: dict[int, Submission] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    def submit_rows(self, sub: Submission) -> Submission:
        """Called on the event loop (the routes); `QueueFull` past the bound, nothing sent then."""
        self.loop = self.loop or asyncio.get_running_loop()
        self._queue(sub.rows)
        rid = next(self._ids)
        self.subs[rid] = sub
        sub.on_cancel = lambda: self.proc.send(("cancel", rid))
        self.proc.send(("rows", rid, sub.prompt_ids, sub.samplings, sub.stops))
        return sub

    def apply(self, deltas: list) -> None:
        """On the event loop: one step's new tokens for the requests in flight."""
        for rid, admitted, version, rows, done, error in deltas:
            sub = self.subs.get(rid)
            if sub is None:
                continue
            with sub.lock:
                for i, ids, logprobs, top, ended in rows:
                    sub.ids[i].extend(ids)
                    sub.logprobs[i].extend(logprobs)
                    if top:
                        sub.top[i].extend(top)
                    sub.ended[i] = ended
                sub.version = version
                if error is not None:
                    sub.error = sub.error or _raise_portable(error)
                newly, sub.admitted = admitted - sub.admitted, admitted
            left = newly + (sub.rows - admitted if done else 0)
            if left:
                self._unqueue(left)
            if done:
                del self.subs[rid]
                sub.done.set()
            for _, event in sub.woken():
                event.set()

    def fail_all(self, error: BaseException) -> None:
        """The engine process is gone: every request in flight ends with `error` (on the event loop)."""
        for sub in list(self.subs.values()):
            sub.finish(error)
        self.subs.clear()

    def describe(self, state: dict | None = None) -> dict:
        """The engine thread's counters (`state`: an answer of the engine process already at hand), with this
        process's queue."""
        state = (state or self.proc.state())["scheduler"]
        return {**state, "rows_queued": self.queued_rows, "max_queued_rows": self.max_queued_rows,
                "refused": self.stats["refused"]}


class EnginePipe:
    """This side of a pipe to an `EngineCore` (`info`: its `engine_info`): send, calls with replies, the reader
    thread. `on_exit(why)` is called (from the reader thread) when the other side has gone without being stopped."""

    def __init__(self, conn, info: dict, on_exit: Callable[[str], None]) -> None:
        self.conn = conn
        self.info = info
        self.on_exit = on_exit
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self.scheduler: RemoteScheduler | None = None
        self.stopping = False
        self.writer = PipeWriter(self.conn, "rlspec-engine-pipe-writer")
        threading.Thread(target=self._read, name="rlspec-engine-pipe", daemon=True).start()

    def send(self, message, body: bytes | None = None) -> None:
        self.writer.send(message, body)

    def call(self, what: str, *args, body: bytes | None = None) -> Future:
        cid = next(self._ids)
        self._calls[cid] = future = Future()
        future.call_id = cid  # what an `abort` names
        self.send(("call", cid, what, args), body)
        return future

    async def call_async(self, what: str, *args, body: bytes | None = None):
        return await asyncio.wrap_future(self.call(what, *args, body=body))

    def state(self) -> dict:
        return self.call("state").result(STATE_TIMEOUT_S)

    def _read(self) -> None:
        while True:
            try:
                messages = received(self.conn.recv())
            except (EOFError, OSError):
                break
            deltas: list = []  # consecutive runs' deltas applied in one call, in order with the replies
            for message in messages:
                if message[0] == "deltas":
                    deltas += message[1]
                    continue
                self._apply(deltas)
                _, cid, ok, value = message
                future = self._calls.pop(cid)
                if future.done():  # its caller gave up
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(_raise_portable(value))
            self._apply(deltas)
        if self.stopping:
            return
        why = self.gone()
        error = RunError(why)
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        if self.scheduler is not None and self.scheduler.loop is not None:
            try:
                self.scheduler.loop.call_soon_threadsafe(self.scheduler.fail_all, error)
            except RuntimeError:  # the loop has closed (the server is stopping)
                pass
        self.on_exit(why)

    def _apply(self, deltas: list) -> None:
        """Hand `deltas` to the event loop (then empties the list)."""
        loop = self.scheduler.loop if self.scheduler is not None else None
        if deltas and loop is not None:
            loop.call_soon_threadsafe(self.scheduler.apply, list(deltas))
        deltas.clear()

    def gone(self) -> str:
        """Why the other side went away unasked (the reader thread found the pipe closed)."""
        return "the engine's side of the pipe closed"

    def stop(self) -> None:
        """Tell the other side this one is done. A message, not the pipe's close: this process's reader thread is
        blocked reading the pipe, which keeps it open for the other side whatever `close` does here (an engine
        process waited out 10 s, then was killed)."""
        self.stopping = True
        self.send(("stop",))
        self.writer.close()
        self.writer.thread.join(STOP_WAIT_S)


class EngineProcess(EnginePipe):
    """The HTTP process's handle on the engine process: start it, then the pipe to it."""

    def __init__(self, build: Callable, plan, engine_index: int, model_name: str, switch_interval: float,
                 on_exit: Callable[[str], None], warm_pool: bool = False, max_model_len: int | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        conn, child = context.Pipe()
        self.proc = context.Process(target=engine_main, name="rlspec-engine",
                                    args=(child, build, plan, engine_index, model_name, switch_interval, warm_pool,
                                          max_model_len))
        self.proc.start()
        child.close()
        try:
            kind, info = conn.recv()
        except EOFError:
            self.proc.join(10)
            raise RunError(f"the engine process exited with code {self.proc.exitcode} before it was ready") from None
        if kind == "failed":
            self.proc.join(10)
            raise _raise_portable(info)
        super().__init__(conn, info, on_exit)

    def gone(self) -> str:
        self.proc.join(5)
        return f"the engine process (pid {self.proc.pid}) exited with code {self.proc.exitcode}"

    def stop(self) -> None:
        """Tell the engine process to exit, then make sure it has."""
        super().stop()
        self.proc.join(STOP_WAIT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


class RemoteHost:
    """`EngineHost`'s face (`app.build_app`, `OpenAIRoutes`) over an engine in a process of its own."""

    def __init__(self, build: Callable, plan, engine_index: int, model_name: str, max_queued_rows: int,
                 switch_interval: float, on_exit: Callable[[str], None], warm_pool: bool = False,
                 max_model_len: int | None = None) -> None:
        """`build(plan, engine_index)`: the engine, in the engine process (`process.build_engine`); `on_exit(why)`:
        called (from a thread of this process) when the engine process has died."""
        self._attach(EngineProcess(build, plan, engine_index, model_name, switch_interval, on_exit, warm_pool,
                                   max_model_len), plan, model_name, max_queued_rows)

    @classmethod
    def over(cls, pipe: EnginePipe, plan, model_name: str, max_queued_rows: int) -> "RemoteHost":
        """The face over an engine that serves `pipe` from another process of its own (the run's process, for the
        agent gateway's processes: `rlspec.agent.processes`)."""
        host = cls.__new__(cls)
        host._attach(pipe, plan, model_name, max_queued_rows)
        return host

    def _attach(self, pipe: EnginePipe, plan, model_name: str, max_queued_rows: int) -> None:
        from ..models.factory import load_tokenizer

        self.model_name = model_name
        self.process = pipe
        info = pipe.info
        self.warmed = info["warmed"]
        self.engine = _EngineView(load_tokenizer(plan.spec.model), plan.spec.rollout, info["sampler"])
        self.thread = pipe.scheduler = RemoteScheduler(pipe, info, max_queued_rows)
        self.engine_pid = info["pid"]
        self.started = time.time()

    @property
    def weight_version(self) -> int | None:
        return self.process.state()["weight_version"]

    def state(self) -> dict:
        state = self.process.state()
        return {**state, "engine_pid": self.engine_pid, "scheduler": self.thread.describe(state)}

    async def label(self, version: int) -> None:
        await self.process.call_async("label", version)

    async def bridge(self, body: bytes) -> tuple[int, str, bytes]:
        return await self.process.call_async("bridge", body=body)

    async def generate_alone(self, *args, abort: Abort | None = None):
        future = self.process.call("generate", *args)
        if abort is not None:
            abort.on_set(lambda: self.process.send(("abort", future.call_id)))
        return await asyncio.wrap_future(future)

    def stop(self) -> None:
        self.process.stop()
