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
