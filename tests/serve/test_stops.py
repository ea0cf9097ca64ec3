"""Stop strings in the decode batch and in streams: the scheduler's check sees every token a decode run hands
over, and a streamed choice's chunks join to the text the same request returns unstreamed, for any stop string."""

from __future__ import annotations

import threading

import pytest

from rlspec.models.factory import load_tokenizer
from rlspec.serve.chat import decoder
from rlspec.serve.pool import Delivery, RowSampling
from rlspec.serve.scheduler import Scheduler, Submission
from rlspec.spec import ModelSpec

RUN = 8
"""Tokens a decode run hands over at once on CUDA (`check_every`)."""


class _OneRun:
    """A pool whose one `run` hands over the given tokens of row 0 at once."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.live, self.released = tokens, {0: 0}, []

    def run(self) -> list[Delivery]:
        return [Delivery(0, 0, self.tokens, [0.0] * len(self.tokens), None, False)]

    def release(self, slots: list[int]) -> None:
        self.released += slots

    def shrink(self) -> None:
        pass


def _scheduler_over(pool) -> Scheduler:
    scheduler = Scheduler.__new__(Scheduler)  # the engine thread's step alone, without an engine
    scheduler.pool, scheduler.stats, scheduler._rows = pool, {"steps": 0}, {}
    return scheduler


@pytest.mark.parametrize("position", range(RUN))
def test_a_stop_anywhere_in_a_decode_run_ends_the_row(position):
    tokenizer = load_tokenizer(ModelSpec())
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    before = encode("Hello, this row has sampled a long text already")  # the tokens of earlier runs
    run = encode("abcdefg")
    run.insert(position, encode("\n")[0])
    assert len(run) == RUN
    sub = Submission([[1, 2]], [RowSampling(0, 100)], ["\n"], decoder(tokenizer))
    sub.ids[0], sub.admitted = list(before), 1
    pool = _OneRun(run)
    scheduler = _scheduler_over(pool)
    scheduler._rows[0] = (sub, 0)
    scheduler._decode()
    assert pool.released == [0] and sub.ended == [True] and sub.done.is_set()


def _random_text(rng, length: int) -> str:
    """Characters of 1 to 4 UTF-8 bytes (no surrogates), ASCII most often."""
    ranges = [(0x20, 0x7E), (0x20, 0x7E), (0xA0, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFD), (0x10000, 0x10FFFF)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(length))


async def _stream_of(kind: str, tokenizer, ids: list[int], stops: list[str], rng) -> tuple[str, str]:
    """(the joined text of a streamed choice, its unstreamed text): `ids` handed over in decode runs of 1 to 8
    tokens, the row ending after the run whose text holds a stop (as the scheduler ends it) or at its last token."""
    import asyncio
    import json

    from rlspec.serve.live import Planned, live_events
    from rlspec.serve.openai_api import Reply

    planned = Planned(stops=stops, tokenizer=tokenizer)
    planned.reply = lambda version, choices: Reply(kind, "m", choices, version, 1, False, 0, tokenizer, True)
    if kind == "chat":
        planned.finish_choice = lambda c: setattr(c, "message", {"role": "assistant", "content": c.text})
    sub = Submission([[1]], [RowSampling(0, len(ids))], stops)
    sub.admitted = 1
    chunks: list[str] = []

    async def consume():
        async for events in live_events(planned, sub):
            chunks.append(events)

    consumer = asyncio.ensure_future(consume())
    sent = 0
    while sent < len(ids):
        run = ids[sent:sent + rng.randint(1, RUN)]
        sent += len(run)
        with sub.lock:
            sub.ids[0] += run
            sub.logprobs[0] += [0.0] * len(run)
            if sent == len(ids) or any(s in planned.decode(sub.ids[0]) for s in stops):
                sub.ended[0] = True
        if sub.ended[0]:
            sub.done.set()
        sub.notify()
        for _ in range(4):  # the stream takes this run before the next one comes
            await asyncio.sleep(0)
        if sub.ended[0]:
            break
    await asyncio.wait_for(consumer, 5)
    text = ""
    for line in "".join(chunks).splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    final = planned.choice_of([1], sub.ids[0], sub.logprobs[0], None)
    return text, final.text


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_text_is_the_unstreamed_text_for_any_stop_string(kind):
    """Random texts handed over in random decode runs, with stops cut out of them (a stop's first character, then
    a multi-byte one: the text before it was once sent, then sent again) and random Unicode stops."""
    import asyncio
    import random

    tokenizer = load_tokenizer(ModelSpec())
    vocab = len(tokenizer)
    for seed in range(150):
        rng = random.Random(seed)
        text = _random_text(rng, rng.randint(1, 30))
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if rng.random() < 0.3:  # bytes that make no character, and ids past the tokenizer
            ids.insert(rng.randrange(len(ids) + 1), rng.randrange(vocab + 4))
        start = rng.randrange(len(text))
        stops = [text[start:start + rng.randint(1, 4)]] if rng.random() < 0.8 else []
        stops += [_random_text(rng, rng.randint(1, 3)) for _ in range(rng.randint(0 if stops else 1, 2))]
        streamed, whole = asyncio.run(_stream_of(kind, tokenizer, ids, stops, rng))
        assert streamed == whole, (seed, text, stops)
