"""A request's rows as the scheduler takes them (`Submission`), the queue's bound the routes check before rows go to it
(`RowQueue`, `QueueFull`: 429), and a job's `Abort` (`rlspec.serve.scheduler` runs them)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .pool import RowSampling

RETRY_AFTER_S = 1
"""What a refused request is told to wait before it retries."""


class QueueFull(Exception):
    """More rows wait for a slot than the server's bound (`rlspec serve --max-queued-rows`)."""

    def __init__(self, queued: int, asked: int, bound: int) -> None:
        super().__init__(f"{queued} rows wait for a decode slot; {asked} more would pass this server's bound of {bound} "
                         f"(rlspec serve --max-queued-rows): retry after {RETRY_AFTER_S} s")
        self.retry_after_s = RETRY_AFTER_S


@dataclass
class Submission:
    """One request's rows in the scheduler, and what they have sampled so far (read under `lock`)."""

    prompt_ids: list[list[int]]
    samplings: list[RowSampling]
    stops: list[str] = field(default_factory=list)
    stop_window: Callable[[list[int]], str] | None = None
    """Decodes a row's last tokens; a row whose recent text holds a stop string leaves (the caller cuts it)."""
    ids: list[list[int]] = field(init=False)
    logprobs: list[list[float]] = field(init=False)
    top: list[list] = field(init=False)
    ended: list[bool] = field(init=False)
    version: int | None = None
    error: BaseException | None = None
    cancelled: bool = False
    admitted: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    on_cancel: Callable[[], None] | None = None
    arrived_s: float = field(default_factory=time.monotonic)
    """When it was made (the request's arrival): how long its rows have waited (`Scheduler.admit_wait_s`)."""
    long: bool = False
    """Set by the scheduler: a row is longer than the pool's rows (it decodes in the long lane)."""
    _listeners: list = field(default_factory=list)

    def __post_init__(self) -> None:
        rows = len(self.samplings)
        self.ids, self.logprobs, self.top = [[] for _ in range(rows)], [[] for _ in range(rows)], [[] for _ in range(rows)]
        self.ended = [False] * rows

    @property
    def rows(self) -> int:
        return len(self.samplings)

    def cancel(self) -> None:
        """The client is gone: its rows leave at the next step (and rows not started never start)."""
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel()

    def listen(self) -> asyncio.Event:
        """An event set (on the caller's event loop) whenever rows got tokens or ended."""
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        self._listeners.append((loop, event))
        if self.done.is_set():
            event.set()
        return event

    def notify(self) -> None:
        for loop, event in self._listeners:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop has closed (the server is stopping)
                pass

    def finish(self, error: BaseException | None = None) -> None:
        with self.lock:
            self.error = self.error or error
            self.ended = [True] * self.rows
        self.done.set()
        self.notify()

    async def wait_async(self, receive: Callable[[], Any] | None = None) -> None:
        """Until every row has ended. `receive` (the ASGI receive of the request, its body already read) is
        listened to meanwhile: a client that goes away cancels the request (its rows leave at the next step), as
        does cancelling the task that waits."""
        async def listen_for_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.cancel()

        event = self.listen()
        watcher = asyncio.ensure_future(listen_for_disconnect()) if receive is not None else None
        try:
            while not self.done.is_set():  # a cancelled request's rows end too (nobody reads its reply)
                await event.wait()
                event.clear()
        except asyncio.CancelledError:  # the waiting task was cancelled (an in-process agent timed out): rows leave
            self.cancel()
            raise
        finally:
            if watcher is not None:
                watcher.cancel()


class Abort:
    """A request that runs alone (a job), given up by its client: set on the event loop, read by the engine between
    tokens (`HFEngine.generate(stop=...)`); `on_set` hooks tell an engine in another process."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._hooks: list[Callable[[], None]] = []

    def set(self) -> None:
        self._set.set()
        for hook in self._hooks:
            hook()

    def is_set(self) -> bool:
        return self._set.is_set()

    def on_set(self, hook: Callable[[], None]) -> None:
        self._hooks.append(hook)


class RowQueue:
    """What the routes ask of a scheduler before rows go to it, kept where the requests arrive: whether rows join
    the decode batch, and the count of rows waiting for a slot against `max_queued_rows` (`Scheduler` here,
    `engine_process.RemoteScheduler` in the HTTP process of an engine of its own). Subclasses set `pool_reason`,
    `row_budget`, `context`, `vocab`, `max_model_len`, `max_queued_rows`, `queued_rows`, `stats` (with "refused") and
    `_count_lock`."""

    def takes(self, prompt_ids: list[list[int]], max_tokens: int) -> bool:
        """Whether rows of these prompts join the decode batch, in the pool or the long lane (else the request runs
        as a job)."""
        return self.pool_reason is None and all(len(p) + max_tokens <= self.row_limit for p in prompt_ids)

    @property
    def row_limit(self) -> int:
        """The longest row the decode batch takes: the long lane's (the model's context, or `--max-model-len`), the
        pool's cache length where neither is known."""
        known = [n for n in (self.context, self.max_model_len) if n is not None]
        return min(known) if known else self.row_budget

    def token_limit(self) -> tuple[int | None, str, str | None]:
        """(the most tokens a row's prompt plus max_tokens may reach here (None: no limit known), what sets it, the
        setting that raises it): the model's context, the server's `--max-model-len`, and, where neither is known
        and rows join the decode batch, the pool's cache length. A request past it is refused (400): past the
        context it would decode positions the model never saw."""
        limits = []
        if self.context is not None:
            limits.append((self.context, f"the model's context of {self.context} positions", None))
        if self.max_model_len is not None:
            limits.append((self.max_model_len, f"this server's limit of {self.max_model_len} tokens a row "
                                               "(rlspec serve --max-model-len)", "--max-model-len"))
        if not limits and self.pool_reason is None:
            limits.append((self.row_budget, f"this server's limit of {self.row_budget} tokens a row (its spec's "
                                            "rollout.max_prompt_tokens + rollout.max_new_tokens, rounded up)",
                           "rollout.max_new_tokens"))
        return min(limits, key=lambda limit: limit[0]) if limits else (None, "", None)

    def _queue(self, rows: int) -> None:
        """Count `rows` as waiting for a slot; `QueueFull` past the bound (nothing counted then)."""
        with self._count_lock:
            if self.queued_rows and self.queued_rows + rows > self.max_queued_rows:
                self.stats["refused"] += 1
                raise QueueFull(self.queued_rows, rows, self.max_queued_rows)
            self.queued_rows += rows

    def _unqueue(self, rows: int) -> None:
        with self._count_lock:
            self.queued_rows -= rows
