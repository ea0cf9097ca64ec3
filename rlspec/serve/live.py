"""A request on its way through the scheduler: its rows as the scheduler takes them (`Submission`), the queue's bound
the routes check before rows go to it (`RowQueue`, `QueueFull`: 429), a job's `Abort`, its plan (`Planned`), the
choice each row becomes, and the live stream of a streamed request (`live_events`), which sends each row's text as
the decode batch samples it (`rlspec.serve.scheduler` runs the rows and jobs).

A streamed row's text goes out as its tokens arrive (on CUDA a few tokens a chunk: the engine reads the batch's
tokens every few decode steps), held back where it may be the start of a stop string or ends in an incomplete
character (tokens that add no text at all send their log-probs at once, with an empty text); when the row ends,
the rest of its final text (cut at the stop string, as the unstreamed reply's) and its finish reason. The chunks'
texts join to the unstreamed text; a request's chunks of one decode run (every row's, and the last ones with
`[DONE]`) go out in one write. A chat choice with tools is sent when it ends (its tool calls are parsed from the
whole text). A client that goes away cancels the request: its rows leave the batch at the next step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from .chat import cut_at_stop, decoder
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

    def listen(self, progress: bool = True) -> asyncio.Event:
        """An event set (on the caller's event loop) whenever rows got tokens or ended, or (`progress` false) only
        once every row has ended."""
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        self._listeners.append((loop, event, progress))
        if self.done.is_set():
            event.set()
        return event

    def woken(self) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]:
        """(loop, event) of the listeners a change wakes: those that follow progress, and every one once done."""
        done = self.done.is_set()
        return [(loop, event) for loop, event, progress in self._listeners if progress or done]

    def notify(self, into: list | None = None) -> None:
        """Wake the listeners a change wakes (`woken`), or add them to `into` for the caller to wake together with
        other requests' (`wake`)."""
        if into is None:
            wake(self.woken())
        else:
            into.extend(self.woken())

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
            await until_disconnect(receive)
            self.cancel()

        event = self.listen(progress=False)  # woken once, not at every decode run of its rows
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


def notify_all(subs) -> None:
    """`Submission.notify` of every request of `subs`, their listeners woken together (`wake`)."""
    listeners: list = []
    for sub in subs:
        sub.notify(listeners)
    wake(listeners)


def wake(listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    """Set each event on its own loop from another thread (the engine's), with one `call_soon_threadsafe` per loop
    however many events it holds: each such call writes to the loop's wake-up pipe and, from the engine thread,
    then waits to take the interpreter lock back from the loop's thread."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    for loop, event in listeners:
        by_loop.setdefault(loop, []).append(event)
    for loop, events in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # the loop has closed (the server is stopping)
            pass


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


async def until_disconnect(receive: Callable[[], Any]) -> None:
    """Return once the request's client has gone away (`receive`: its ASGI receive, the body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


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


@dataclass
class Choice:
    """One sampled choice, cut at its stop string."""

    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None
    text: str
    finish_reason: str
    message: dict[str, Any] | None = None
    """Chat: the assistant message (content, tool_calls)."""
    malformed_tool_calls: int = 0


@dataclass
class Planned:
    """A request planned by the routes: rows for the decode batch, or `generate`, the arguments of the engine job
    that samples it alone (`openai_api.generate_alone`: a request the batch cannot take); and how sampled rows become
    the reply."""

    stops: list[str]
    tokenizer: Any
    rows: list[list[int]] | None = None
    samplings: list | None = None
    generate: tuple | None = None
    reply: Callable | None = None
    """(version, choices) -> the `Reply`."""
    finish_choice: Callable[[Choice], None] = lambda choice: None
    """Chat: the assistant message (tool calls parsed) of a finished choice."""
    tools: bool = False
    decode: Callable[[list[int]], str] = field(init=False)

    def __post_init__(self) -> None:
        self.decode = decoder(self.tokenizer)

    def choice_of(self, prompt_ids: list[int], ids: list[int], logps: list[float], top) -> Choice:
        """A row's choice: ended by the end token ("stop") or its length, or cut at its first stop string."""
        finish = "stop" if ids and ids[-1] == self.tokenizer.eos_token_id else "length"
        cut = cut_at_stop(self.decode, ids, self.stops)
        if cut is not None:
            kept, text = cut
            return Choice(prompt_ids, ids[:kept], logps[:kept], top[:kept] if top else top, text, "stop")
        return Choice(prompt_ids, ids, logps, top, self.decode(ids), finish)

    def rollout_choices(self, version, rollout) -> tuple[int | None, list[Choice]]:
        tops = rollout.top_logprobs
        return version, [self.choice_of(p, ids, logps, tops[i] if tops is not None else None)
                         for i, (p, ids, logps) in enumerate(zip(rollout.prompt_ids, rollout.completion_ids,
                                                                 rollout.completion_logprobs))]

    def submission_choices(self, sub: Submission) -> tuple[int | None, list[Choice]]:
        if sub.error is not None:
            raise sub.error
        wants_top = any(s.top_logprobs for s in sub.samplings)
        return sub.version, [self.choice_of(p, sub.ids[i], sub.logprobs[i], sub.top[i] if wants_top else None)
                             for i, p in enumerate(sub.prompt_ids)]


@dataclass
class _RowStream:
    """What a streamed row has sent: its text, and its tokens whose log-probs went out."""

    started: bool = False
    sent: str = ""
    tokens_sent: int = 0
    ended: bool = False


def _held(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` to hold back: any incomplete character (decoded as U+FFFD: the next tokens
    may complete it), and before it the longest end that starts a stop string (the next tokens may complete the
    stop, which the final text is cut before). What goes out is then always a prefix of the final text."""
    whole = text.rstrip("\ufffd")
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(whole)), held, -1):
            if whole.endswith(stop[:k]):
                held = k
                break
    return len(text) - len(whole) + held


async def live_events(planned: Planned, sub: Submission) -> AsyncIterator[str]:
    """The server-sent events of a streamed request, as its rows sample (see the module docstring)."""
    reply = planned.reply(None, [])
    kind = reply.kind
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    rows = [_RowStream() for _ in range(sub.rows)]
    partial = [Choice(p, [], [], [], "", "") for p in sub.prompt_ids]
    finals: list[Choice | None] = [None] * sub.rows
    event = sub.listen()

    def chunk(i: int, delta: str | None = None, logprobs=None, finish_reason=None, message: dict | None = None):
        if kind == "chat":
            body = {"index": i, "delta": message if message is not None else ({"content": delta} if delta is not None else {}),
                    "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            body = {"index": i, "text": delta or "", "logprobs": logprobs, "finish_reason": finish_reason}
        out = {**reply._head(obj), "choices": [body]}
        if finish_reason is not None:
            out["weight_version"] = sub.version
        return f"data: {json.dumps(out)}\n\n"

    def logprobs_of(c: Choice, start: int, end: int):
        if not reply.show_logprobs or end <= start:
            return None
        return {"content": reply._chat_logprobs(c, start, end)} if kind == "chat" else reply._completion_logprobs(c, start, end)

    try:
        while True:
            await event.wait()
            event.clear()
            out: list[str] = []  # this wake's chunks, every row's, sent as one write
            with sub.lock:
                snapshot = [(list(sub.ids[i]), list(sub.logprobs[i]), list(sub.top[i]), sub.ended[i])
                            for i in range(sub.rows)]
            if sub.error is not None:
                raise sub.error
            for i, (ids, logps, top, ended) in enumerate(snapshot):
                state, c = rows[i], partial[i]
                if state.ended or (not ids and not ended):
                    continue
                c.ids, c.logprobs, c.top = ids, logps, top or None
                if not state.started:
                    state.started = True
                    if kind == "chat":
                        out.append(chunk(i, message={"role": "assistant", "content": ""}))
                    elif reply.echo_texts:
                        out.append(chunk(i, reply.echo_texts[i // reply.n]))
                if ended:
                    state.ended = True
                    final = planned.choice_of(c.prompt_ids, ids, logps, top or None)
                    planned.finish_choice(final)
                    finals[i] = final
                    out.extend(_final_chunks(reply, i, final, state, chunk, logprobs_of, planned.tools))
                    continue
                if planned.tools:
                    continue  # a chat choice with tools goes out whole when it ends
                text = planned.decode(ids)
                if any(stop in text for stop in planned.stops):
                    continue  # the row is ending at its stop string: its final text goes out then
                ready = text[:len(text) - _held(text, planned.stops)]
                if ready.startswith(state.sent) and len(ready) > len(state.sent):
                    out.append(chunk(i, ready[len(state.sent):], logprobs_of(c, state.tokens_sent, len(ids))))
                    state.sent, state.tokens_sent = ready, len(ids)
                elif text == state.sent and len(ids) > state.tokens_sent and reply.show_logprobs:
                    # Tokens that add no text and hold none back (ids the tokenizer decodes to nothing: special
                    # tokens, a random-init model's ids past its tokenizer): their log-probs go out now.
                    out.append(chunk(i, "", logprobs_of(c, state.tokens_sent, len(ids))))
                    state.tokens_sent = len(ids)
            if all(state.ended for state in rows):
                break
            if out:
                yield "".join(out)
        if reply.include_usage:
            done = planned.reply(sub.version, finals)
            out.append(f"data: {json.dumps({**reply._head(obj), 'choices': [], 'usage': done.usage()})}\n\n")
        out.append("data: [DONE]\n\n")
        yield "".join(out)
    finally:
        if not all(state.ended for state in rows):
            sub.cancel()


def _final_chunks(reply, i: int, final: Choice, state: _RowStream, chunk, logprobs_of, tools: bool):
    """The rest of a row that ended: its text not yet sent (or, chat with tool calls, its content and calls), the
    log-probs not yet sent, then its finish reason."""
    calls = (final.message or {}).get("tool_calls")
    if reply.kind == "chat" and (tools or calls):
        content = final.message.get("content")
        logprobs = logprobs_of(final, 0, len(final.ids))
        if content:
            yield chunk(i, content, logprobs)
            logprobs = None
        if calls:
            yield chunk(i, message={"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]},
                        logprobs=logprobs)
    else:
        text = final.message.get("content") or "" if final.message is not None else final.text
        rest = text[len(state.sent):]  # what was sent is a prefix of it (`_held`): never sent twice
        logprobs = logprobs_of(final, state.tokens_sent, len(final.ids))
        if rest or logprobs is not None:
            yield chunk(i, rest, logprobs)
    yield chunk(i, None, None, final.finish_reason)
