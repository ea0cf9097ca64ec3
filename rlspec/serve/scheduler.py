"""The server's scheduler: one engine thread that decodes every request in flight in one batch.

    loop on the engine thread:
        take what arrived (requests' rows, and jobs: bridge operations, weight labels, requests the pool cannot take)
        a job at the head of the queue runs once no row is in flight (rows behind it wait: the queue's order holds)
        admit queued rows into free slots of the pool (`rlspec.serve.pool.ServingPool`), at the next step
        decode a few steps; hand each row its new tokens; rows that ended (end token, max tokens, a stop
        string, a client gone) leave at once and their slots take the next rows

Weight versions: a job that writes weights waits for the rows in flight (admission stops at it, the rows drain,
then it runs), so a completion's rows are all sampled with one set of weights, and a request reports the version
the server held when its first row started (`Submission.version`). No completion spans a push. When rows start in
an idle pool after a job ran (or after anything, where a colocated trainer's steps write the module the engine
shares: the agent gateway's), the pool first refreshes what it derives from the weights (fused copies, kept
prefills).

Back-pressure: rows that wait for a slot are counted; a request that would take them past `max_queued_rows` is
refused (`QueueFull`: 429 with Retry-After) unless nothing waits (a request larger than the bound alone is
accepted). A request accepted is never dropped: only its client can cancel it (`Submission.cancel`, when it
disconnects), which frees its rows at the next step.

Two lanes: a row whose prompt plus max_tokens fits the pool's cache length (`rollout.max_prompt_tokens +
rollout.max_new_tokens`, rounded up) decodes in the pool; a longer one, up to the model's context (or the server's
`--max-model-len`), in the long lane: a second pool of `LONG_SLOTS` rows of that length, made at its first row,
decoded in the same loop turn by turn with the first. Both lanes count against the queue's bound, a gone client's
rows leave either at the next step, and a short request never waits for a long one. Past the model's context (or
`--max-model-len`) the routes refuse the request (`RowQueue.token_limit`).

Requests the pool cannot take at all (an engine that is not in this process, a model the slot pool cannot run) run
as jobs, one at a time; their rows count against the same bound while they wait and run, and a client that goes
away stops its job at the next token (`Abort`).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import queue
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from ..errors import SpecError
from .pool import ServingPool
from .live import RETRY_AFTER_S, Abort, QueueFull, RowQueue, Submission, notify_all  # noqa: F401 - the routes' names

BESIDE_THREADS = 256
"""Requests in flight at once to an engine outside this process (`Scheduler.run_async(beside=True)`)."""


LONG_SLOTS = 4
"""Rows the long lane decodes at once (its cache: this many rows of the model's context, or `--max-model-len`)."""

ADMIT_SHARE = 0.25
"""With `Scheduler.admit_wait_s` set and rows in flight, queued rows start once they are this share of them."""
ADMIT_COST_WEIGHT = 0.25
"""The weight of the latest admission in `Scheduler.admit_cost_s` (an exponential moving average)."""

SLOW_DECODE_S = 0.1
"""A decode run longer than this counts in `slow_decodes` (a run is up to 8 steps: a few ms when nothing stalls it)."""


_gc_seconds = [0.0, 0.0]
"""[seconds this process has spent in the garbage collector since the first scheduler, when the running pass began]."""


def _gc_clock() -> float:
    """This process's seconds in the garbage collector (counted from the first call on)."""
    import gc

    if _gc_callback not in gc.callbacks:
        gc.callbacks.append(_gc_callback)
    return _gc_seconds[0]


def _gc_callback(phase: str, _info: dict) -> None:
    if phase == "start":
        _gc_seconds[1] = time.perf_counter()
    else:
        _gc_seconds[0] += time.perf_counter() - _gc_seconds[1]


@dataclass
class _Job:
    fn: Callable
    args: tuple
    future: Future


class Scheduler(RowQueue):
    """The engine thread (see the module docstring). `host` supplies the weight version a request reports."""

    def __init__(self, engine, host, max_queued_rows: int,
                 on_submitted_error: Callable[[BaseException], None] | None = None,
                 on_submitted_start: Callable[[], None] | None = None, owns_weights: bool = False,
                 max_model_len: int | None = None) -> None:
        self.engine = engine
        self.owns_weights = owns_weights
        """Nothing but this scheduler's jobs writes the engine's weights (`rlspec serve`'s own engine): the pool's
        derived copies are refreshed after a job, not whenever rows start in an idle pool (an H100 took ~25 ms
        for that, the 0.5B shape, at the start of every burst)."""
        self._job_ran = False
        self.host = host
        self.device = getattr(engine, "device", None)
        self._cuda_index = _cuda_index(self.device)
        """The engine's CUDA device, which the engine thread makes its current one (None off CUDA)."""
        self.max_queued_rows = max_queued_rows
        self.on_submitted_error = on_submitted_error
        self.on_submitted_start = on_submitted_start
        self.pool_reason = pool_unsupported(engine)
        """None when requests join the decode batch; else why each runs alone."""
        self.outside = _outside(engine)
        """The engine samples in other processes (the agent gateway's view of Ray engines or a server)."""
        self._beside: ThreadPoolExecutor | None = None
        self.row_budget = row_budget(engine) if self.pool_reason is None else 0
        """Prompt plus max tokens a row of the pool may reach (its cache length)."""
        self.context = model_context(engine)
        """The model's positions (None where unknown: an engine outside this process)."""
        self.vocab = model_vocab(engine)
        """The token ids the model embeds (None where unknown): a prompt's ids may be any of them."""
        if max_model_len is not None and self.context is not None and max_model_len > self.context:
            raise SpecError("--max-model-len", f"{max_model_len} is past the model's context of {self.context} "
                                               "positions", f"give at most --max-model-len {self.context}, or leave "
                                                            "it out (the model's context)")
        self.max_model_len = max_model_len
        """The server's own limit on a row's prompt plus max tokens (`rlspec serve --max-model-len`), or None."""
        self.pool: ServingPool | None = None
        self.long_pool: ServingPool | None = None
        """The long lane (`LONG_SLOTS` rows of `row_limit` positions), made at its first row."""
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: deque = deque()
        self.queued_rows = 0
        self._count_lock = threading.Lock()
        self._rows: dict[int, tuple[Submission, int]] = {}
        self._ids = itertools.count()
        self._cancelled = threading.Event()
        """Set when a client cancels: the next step looks for its rows."""
        self.stats = {"steps": 0, "rows_admitted": 0, "long_rows_admitted": 0, "rows_cancelled": 0, "refused": 0,
                      "max_rows_in_flight": 0,
                      "admits": 0, "admit_s": 0.0, "decode_s": 0.0, "slow_decodes": 0,
                      "engine_errors": 0}
        """Counters since start (`rows_cancelled`: rows of the decode batch and of jobs' requests; `long_rows_admitted`:
        rows started in the long lane); `admit_s`, `decode_s`: the engine thread's seconds in admissions (`admits` of
        them: prefill, pool resize, copies into slots) and in decode runs (`steps` of them, each up to `check_every`
        decode steps of one lane and the read of their tokens), host clock; `slow_decodes`: decode runs over
        `SLOW_DECODE_S`; `engine_errors`: turns of the engine thread that failed outside an admission or a decode run
        (`_broken`).
        `describe` adds `gc_s` (this process's seconds in Python's garbage collector since the scheduler started, any
        thread) and the pool's `captures` and `capture_s` (decode steps and packed prefills captured as CUDA graphs,
        within the decode runs' and admissions' time)."""
        self.admit_wait_s = 0.0
        """With rows in flight, queued rows start together: once they are `ADMIT_SHARE` of the rows in flight (or
        fill the free slots), or the oldest has waited this long; 0 starts them at the next step, whatever their
        number. An admission's host time (a prefill forward, the copies into slots) holds every row's decode, and it
        is about the same for one row as for many: agents' turns arrive one by one (the agent gateway sets it).
        The wait is never longer than an admission has lately cost (`admit_cost_s`): waiting longer than the admission
        it saves cannot pay off (the rows could have started, and the next ones after them, in that time). On one
        H200, 8 agent processes of the chat example: 30 ms of wait against admissions of ~9 ms held a step of 64
        agents at ~95 ms (docs/agents.md)."""
        self.admit_cost_s: float | None = None
        """A moving average of an admission's host time (seconds), None before the first."""
        self._gc_at_start = _gc_clock()
        self.on_iteration: Callable[[], None] | None = None
        """Called on the engine thread before each turn of its loop (and so before it waits for work): the engine
        process sends the turn's tokens from it (`engine_process.EngineCore.flush`)."""
        threading.Thread(target=self._loop, name="rlspec-engine", daemon=True).start()

    # --- what other threads call ------------------------------------------------------------------------
    def submit_rows(self, submission: Submission) -> Submission:
        """Queue a request's rows; `QueueFull` past the bound (nothing queued then)."""
        self._queue(submission.rows)
        submission.on_cancel = self._cancelled.set
        self.inbox.put(submission)
        return submission

    def run(self, fn, *args):
        """`fn(*args)` on the engine thread once no row is in flight; blocks the caller until it returns."""
        done: Future = Future()
        self.inbox.put(_Job(fn, args, done))
        return done.result()

    async def run_async(self, fn, *args, beside: bool = False):
        """`run` for the event loop: queued now, in arrival order, no worker thread held while it waits. `beside`:
        run it in a thread of its own instead, at once (an engine outside this process, which serves calls
        concurrently: the agent gateway's Ray engines or rollout server)."""
        if beside:
            if self._beside is None:
                self._beside = ThreadPoolExecutor(BESIDE_THREADS, thread_name_prefix="rlspec-engine-call")
            return await asyncio.get_running_loop().run_in_executor(self._beside, fn, *args)
        done: Future = Future()
        self.inbox.put(_Job(fn, args, done))
        return await asyncio.wrap_future(done)

    def submit(self, fn, *args, due: Callable[[], bool] | None = None) -> None:
        """Queue `fn(*args)` without waiting (a transport's engine half that it starts on its own; the trainer's
        bridge call collects the outcome). `on_submitted_start` runs first; a failure goes to `on_submitted_error`.
        `due`, checked on the engine thread first: a job no longer due (its push already ran, through the bridge
        call) runs nothing and leaves the weights' label as it is."""
        def guarded():
            if due is not None and not due():
                return
            if self.on_submitted_start is not None:
                self.on_submitted_start()
            try:
                fn(*args)
            except BaseException as err:  # noqa: BLE001 - the bridge call reports it; the host marks the weights
                if self.on_submitted_error is not None:
                    self.on_submitted_error(err)

        self.inbox.put(_Job(guarded, (), Future()))

    def warm_pool(self) -> tuple[int, float]:
        """The slot pool made, and the plain decode step of every pool size and the packed prefill of every token
        bucket captured now (on the engine thread; the caller waits), not when traffic first reaches that size (an
        H100 took 2.3 s to compile and capture the 256-slot step in the middle of a burst: every row in flight
        waited). (graphs captured, seconds)."""
        return self.run(self._warm_pool)

    def _warm_pool(self) -> tuple[int, float]:
        """The pool and, where rows may pass its length, the long lane (whose prefills are the pool's)."""
        if self.pool_reason is not None:
            return 0, 0.0
        if self.pool is None:
            self.pool = make_pool(self.engine)
        if self.long_pool is None and self.row_limit > self.pool.length:
            self.long_pool = make_pool(self.engine, self.row_limit, self.pool)
        captures, seconds = self._captures()
        for pool in self._pools():
            pool.warm_up()
        now = self._captures()
        return now[0] - captures, now[1] - seconds

    def _pools(self) -> list[ServingPool]:
        return [pool for pool in (self.pool, self.long_pool) if pool is not None]

    def _live(self) -> int:
        return sum(len(pool.live) for pool in self._pools())

    def _captures(self) -> tuple[int, float]:
        """Graphs the lanes captured and their seconds (the long lane's prefills are the pool's: counted once)."""
        main, long = self.pool, self.long_pool
        if main is None:
            return 0, 0.0
        extra = (long._decode_captures, long._decode_capture_s) if long is not None else (0, 0.0)
        return main.captures + extra[0], main.capture_s + extra[1]

    def describe(self) -> dict:
        captures, capture_s = self._captures()
        return {"batching": "continuous" if self.pool_reason is None else f"one request at a time ({self.pool_reason})",
                "rows_in_flight": self._live(),
                "long_rows_in_flight": len(self.long_pool.live) if self.long_pool else 0,
                "rows_queued": self.queued_rows, "max_queued_rows": self.max_queued_rows,
                "row_limit": self.row_limit if self.pool_reason is None else None, **self.stats,
                "gc_s": round(_gc_clock() - self._gc_at_start, 4), "captures": captures,
                "capture_s": round(capture_s, 4), "prefix_cache": self._prefix_cache()}

    def _prefix_cache(self) -> dict | None:
        """The pool's prefix cache (`kv.prefix.PrefixCache`, shared with the long lane): its counters since start and
        the tokens it holds against its bound; None before the pool is made."""
        if self.pool is None:
            return None
        cache = self.pool.prefills.prefix
        return {**cache.stats, "tokens": cache.tokens, "max_tokens": cache.max_tokens}

    # --- the engine thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        import torch

        from ..sync.base import bind_engine_thread

        if self._cuda_index is not None:
            torch.cuda.set_device(self._cuda_index)
        bind_engine_thread(self.submit)
        failing = 0  # turns failed in a row
        while True:
            try:
                self._turn()
                failing = 0
            except BaseException as err:  # noqa: BLE001 - a dead engine thread would leave every request hanging
                failing += 1
                self._broken(err, show=failing <= 3)
                time.sleep(0.1 * min(failing - 1, 10))  # a failure that repeats does not spin the thread

    def _turn(self) -> None:
        """One turn of the engine thread's loop: new work taken, jobs run, rows admitted, each lane decoded."""
        if self.on_iteration is not None:
            self.on_iteration()
        self._take(block=not self.waiting and not self._live())
        self._run_jobs()
        self._drop_cancelled()
        began = time.perf_counter()
        if self._admit():
            took = time.perf_counter() - began
            self.stats["admits"] += 1
            self.stats["admit_s"] += took
            cost = self.admit_cost_s
            self.admit_cost_s = took if cost is None else cost + ADMIT_COST_WEIGHT * (took - cost)
        for pool in self._pools():  # the lanes take turns: a short row never waits for a long one's end
            if pool.live:
                began = time.perf_counter()
                self._decode(pool)
                took = time.perf_counter() - began
                self.stats["decode_s"] += took
                self.stats["slow_decodes"] += took > SLOW_DECODE_S

    def _broken(self, err: BaseException, show: bool = True) -> None:
        """A turn failed outside the admission's and the decode's own handling: its traceback to stderr (`show`: the
        first few of a run of failures), every request in flight or queued fails with `err` (a client gets an error,
        not a stream that never ends), and the lanes are made again at the next request (a pool the failure left
        half-updated is not reused). Jobs stay queued."""
        if show:
            traceback.print_exception(err, file=sys.stderr)
        print(f"rlspec serve: the engine thread's turn failed ({type(err).__name__}: {err}); the requests in flight "
              "and queued fail with it, and the engine goes on", file=sys.stderr, flush=True)
        self.stats["engine_errors"] += 1
        failed = {id(sub): sub for sub, _ in self._rows.values()}
        failed.update((id(item), item) for item in self.waiting if isinstance(item, Submission))
        self.waiting = deque(item for item in self.waiting if not isinstance(item, Submission))
        self._rows.clear()
        self.pool = self.long_pool = None
        for sub in failed.values():
            self._unqueue(sub.rows - sub.admitted)
            sub.admitted = sub.rows
            sub.cancel()
            sub.finish(err)

    def _take(self, block: bool) -> None:
        try:
            self._arrived(self.inbox.get(block=block))
            while True:
                self._arrived(self.inbox.get_nowait())
        except queue.Empty:
            pass

    def _arrived(self, item) -> None:
        if isinstance(item, Submission):
            item.long = any(len(p) + s.max_tokens > self.row_budget for p, s in zip(item.prompt_ids, item.samplings))
        self.waiting.append(item)

    def _run_jobs(self) -> None:
        """Jobs at the head of the queue, once the rows in flight have drained."""
        while self.waiting and isinstance(self.waiting[0], _Job) and not self._live():
            job = self.waiting.popleft()
            self._job_ran = True
            if job.future.set_running_or_notify_cancel():
                try:
                    job.future.set_result(job.fn(*job.args))
                except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                    job.future.set_exception(err)

    def _drop_cancelled(self) -> None:
        if not self._cancelled.is_set():
            return
        self._cancelled.clear()
        kept = deque()
        for item in self.waiting:
            if isinstance(item, Submission) and item.cancelled:
                self._unqueue(item.rows - item.admitted)
                self.stats["rows_cancelled"] += item.rows - item.admitted
                item.finish()
            else:
                kept.append(item)
        self.waiting = kept
        for pool in self._pools():
            gone = [slot for slot, row in pool.live.items() if self._rows[row][0].cancelled]
            if gone:
                rows = [pool.live[slot] for slot in gone]
                pool.release(gone)  # first the slots, then the count, then the requests' ends: a reader that sees
                self.stats["rows_cancelled"] += len(gone)  # a request done sees its rows counted and freed
                subs = {id(sub): sub for sub, _ in (self._rows[row] for row in rows)}
                for row in rows:
                    self._end_row(row)
                notify_all(subs.values())

    def _admit(self) -> bool:
        """Rows of the requests at the head of the queue into the free slots of their lane, all of a lane in one
        `ServingPool.admit` (one batched prefill, one resize of the pool), not a request at a time: requests that
        arrive together start together. A lane that is full holds back its own requests only. Whether any rows
        were taken."""
        while self.pool is None and self.waiting and isinstance(self.waiting[0], Submission):
            try:
                self.pool = make_pool(self.engine)
            except BaseException as err:  # noqa: BLE001 - e.g. out of device memory: this request fails
                self._fail(self.waiting[0], err)
        if self.pool is None or not (self.waiting and isinstance(self.waiting[0], Submission)):
            return False
        if not self._live() and (self._job_ran or not self.owns_weights):
            # Weights may have changed while the lanes were idle: a job (a push), or a colocated trainer's step
            # on the module an in-process engine shares with it (the agent gateway's).
            for pool in self._pools():
                pool.refresh_weights()
            self._job_ran = False
        lanes: dict[int, tuple[ServingPool, list, list]] = {}  # id(pool) -> (pool, rows, taken)
        free = {id(pool): pool.free() for pool in self._pools()}
        if not self._batch_ready(free[id(self.pool)]):
            free[id(self.pool)] = 0  # the pool's queued rows wait to start together (the long lane's need not)
        long_waiting = any(isinstance(sub, Submission) and sub.long for sub in self.waiting)
        for sub in list(self.waiting):
            if not isinstance(sub, Submission):
                break
            if not free[id(self.pool)] and not (long_waiting and free.get(id(self.long_pool), 1)):
                break
            pool = self._lane(sub)
            if pool is None:
                continue
            free.setdefault(id(pool), pool.free())
            room = free[id(pool)]
            if not room:
                continue
            _, rows, taken = lanes.setdefault(id(pool), (pool, [], []))  # taken: (sub, first row now, one past last)
            if sub.admitted == 0:
                sub.version = self.host.weight_version
            start, stop = sub.admitted, min(sub.rows, sub.admitted + room)
            for i in range(start, stop):
                row = next(self._ids)
                self._rows[row] = (sub, i)
                rows.append((row, sub.prompt_ids[i], sub.samplings[i]))
            taken.append((sub, start, stop))
            free[id(pool)] -= stop - start
        for pool, rows, taken in lanes.values():
            self._admit_rows(pool, rows, taken)
        self.stats["max_rows_in_flight"] = max(self.stats["max_rows_in_flight"], self._live())
        return bool(lanes)

    def _batch_ready(self, free: int) -> bool:
        """Whether the pool's queued rows start now (`admit_wait_s`): no rows in flight, enough rows queued, or the
        oldest queued long enough (`admit_wait_s`, or what an admission lately cost if less)."""
        if not free or not self.admit_wait_s or not self.pool.live:
            return True
        queued, oldest = 0, math.inf
        for sub in self.waiting:
            if not isinstance(sub, Submission):
                break
            queued += sub.rows - sub.admitted
            oldest = min(oldest, sub.arrived_s)
        wait = self.admit_wait_s if self.admit_cost_s is None else min(self.admit_wait_s, self.admit_cost_s)
        return (queued >= min(free, max(1, math.ceil(len(self.pool.live) * ADMIT_SHARE)))
                or time.monotonic() - oldest >= wait)

    def _lane(self, sub: Submission) -> ServingPool | None:
        """The pool `sub`'s rows decode in: the long lane's made at its first row (None: it could not be; `sub`
        failed)."""
        if not sub.long:
            return self.pool
        if self.long_pool is None:
            try:
                self.long_pool = make_pool(self.engine, self.row_limit, self.pool)
            except BaseException as err:  # noqa: BLE001 - e.g. out of device memory: this request fails
                self._fail(sub, err)
                return None
        return self.long_pool

    def _fail(self, sub: Submission, err: BaseException) -> None:
        """A queued request (none of its rows in flight) fails with `err`."""
        self.waiting.remove(sub)
        self._unqueue(sub.rows - sub.admitted)
        sub.finish(err)

    def _admit_rows(self, pool: ServingPool, rows: list, taken: list) -> None:
        try:
            pool.admit(rows)
        except BaseException as err:  # noqa: BLE001 - these requests fail; the server goes on
            for row, _, _ in rows:
                self._rows.pop(row)
            for sub, _, _ in taken:
                self.waiting.remove(sub)
                self._unqueue(sub.rows - sub.admitted)
                sub.cancel()  # rows of it already in flight leave at the next step
                sub.finish(err)
            return
        for sub, start, stop in taken:
            sub.admitted = stop
            self._unqueue(stop - start)
            self.stats["rows_admitted"] += stop - start
            self.stats["long_rows_admitted"] += (stop - start) if sub.long else 0
            if sub.admitted == sub.rows:
                self.waiting.remove(sub)

    def _decode(self, pool: ServingPool | None = None) -> None:
        """One decode run of `pool` (the pool by default): each row's new tokens to its request, ended rows out."""
        pool = pool or self.pool
        try:
            deliveries = pool.run()
        except BaseException as err:  # noqa: BLE001 - the rows in flight fail; the server goes on
            live = dict(pool.live)
            pool.release(list(live))
            for sub in {self._rows[row][0] for row in live.values()}:
                sub.finish(err)
            for row in live.values():
                self._rows.pop(row, None)
            return
        self.stats["steps"] += 1
        touched, stopped = {}, []
        for d in deliveries:
            sub, i = self._rows[d.row_id]
            with sub.lock:
                sub.ids[i].extend(d.tokens)
                sub.logprobs[i].extend(d.logprobs)
                if d.top is not None:
                    sub.top[i].extend(d.top)
            touched[id(sub)] = sub
            if d.ended:
                self._end_row(d.row_id)
            elif sub.stops and sub.stop_window is not None and _stopped(sub, i, len(d.tokens)):
                stopped.append(d.slot)
                self._end_row(d.row_id)
        try:
            pool.release(stopped)
            pool.shrink()
        finally:  # requests done are woken even if these fail (the turn's failure fails only those still in flight)
            notify_all(touched.values())  # one wake-up per event loop, not one per request

    def _end_row(self, row: int) -> None:
        """Row `row` has ended; its request is done once all its rows have (the caller wakes its listeners)."""
        sub, i = self._rows.pop(row)
        with sub.lock:
            sub.ended[i] = True
            last = all(sub.ended)
        if last and sub.admitted == sub.rows:
            sub.done.set()


def _stopped(sub: Submission, i: int, new: int) -> bool:
    """Whether row `i`'s text holds a stop string after its `new` latest tokens (one decode run's: up to 8 on
    CUDA). A stop completed by any of them ends within the window decoded: those tokens and, before them, the
    4 L tokens a stop of L characters spans at most in a byte-level vocabulary, plus one."""
    window = new + 4 * max(len(s) for s in sub.stops) + 1
    text = sub.stop_window(sub.ids[i][-window:])
    return any(s in text for s in sub.stops)


def _cuda_index(device) -> int | None:
    """The index of `device` where it is a CUDA device, else None. "cuda" alone is the calling thread's current
    device (`torch.cuda.set_device` takes no device without an index, and a new thread's current one may differ)."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return None
    index = torch.device(device).index
    return index if index is not None else torch.cuda.current_device()


def _outside(engine) -> bool:
    from ..rollout.hf import HFEngine

    return not isinstance(engine, HFEngine)


def pool_unsupported(engine) -> str | None:
    """Why `engine`'s requests cannot join one decode batch (None when they can)."""
    from ..rollout.decoder import unsupported_reason
    from ..rollout.hf import HFEngine

    if not isinstance(engine, HFEngine):
        return f"the engine ({type(engine).__name__}) samples outside this process"
    return unsupported_reason(engine.model)


def model_vocab(engine) -> int | None:
    """The token ids `engine`'s model embeds (its config's `vocab_size`, or the engine's own `vocab_size`), None if
    unknown. A random-init preset's (152k for the 0.5B shape) exceeds its byte tokenizer's 260 ids, and the model
    samples ids past the tokenizer's: an agent that sends a turn back as ids sends those too."""
    vocab = getattr(engine, "vocab_size", None)
    if vocab is None:
        vocab = getattr(getattr(getattr(engine, "model", None), "config", None), "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def model_context(engine) -> int | None:
    """The positions `engine`'s model was built for (its config's `max_position_embeddings`), None if unknown."""
    config = getattr(getattr(engine, "model", None), "config", None)
    context = getattr(config, "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def row_budget(engine) -> int:
    """The pool's cache length: `rollout.max_prompt_tokens + rollout.max_new_tokens`, rounded up as a pool rounds it."""
    from ..rollout.static import CACHE_STEP

    spec = engine.spec
    return math.ceil((spec.max_prompt_tokens + spec.max_new_tokens) / CACHE_STEP) * CACHE_STEP


def make_pool(engine, length: int | None = None, beside: ServingPool | None = None) -> ServingPool:
    """The slot pool over `engine`'s model: its CUDA-graph sampler on CUDA (`rollout.cuda_graph`), else the same
    step run eagerly. With `length` the long lane's: `LONG_SLOTS` rows of `length` positions, taking its prompts'
    prefills from `beside`'s (a prompt is never longer than `rollout.max_prompt_tokens` in either)."""
    from ..rollout.static import GraphSampler

    sampler = engine._fast_sampler() or GraphSampler(engine.model, engine.device, use_graphs=False)
    eos = engine.tokenizer.eos_token_id
    if length is None:
        return ServingPool(sampler, row_budget(engine), engine.spec.decode_slots, eos)
    return ServingPool(sampler, length, LONG_SLOTS, eos, floor=LONG_SLOTS, prefills=beside.prefills)
