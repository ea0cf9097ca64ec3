"""The scheduler's engine thread on CPU, without a server: queued rows waiting to start together, one wake-up per
event loop for a decode run's requests, a turn that fails outside an admission or a decode run, and the CUDA device
it binds."""

from __future__ import annotations

import asyncio
import time

import torch

MODEL = "tiny_qwen2"


def _scheduler():
    """A scheduler over the tiny model's engine on CPU (its engine thread started)."""
    from rlspec.models.factory import load_model, load_tokenizer
    from rlspec.rollout.hf import HFEngine
    from rlspec.serve.app import EngineHost
    from rlspec.spec import ModelSpec, RolloutSpec

    spec = ModelSpec()
    engine = HFEngine(load_model(spec, 0).eval().requires_grad_(False), load_tokenizer(spec),
                      RolloutSpec(max_new_tokens=32), "cpu")
    return EngineHost(engine, MODEL).thread


def test_with_admit_wait_rows_queued_behind_rows_in_flight_start_together():
    """`Scheduler.admit_wait_s` (the agent gateway's): with rows in flight, queued rows wait for a quarter of their
    number (or the free slots), or for the oldest to have waited that long, or as long as an admission lately cost
    (`admit_cost_s`) if less; an idle pool starts them at once."""
    from types import SimpleNamespace

    from rlspec.serve.pool import RowSampling
    from rlspec.serve.scheduler import Scheduler, Submission

    def sub(rows: int, age_s: float = 0.0) -> Submission:
        out = Submission(prompt_ids=[[5]] * rows, samplings=[RowSampling(key=0, max_tokens=4)] * rows)
        out.arrived_s -= age_s
        return out

    def ready(waiting, live: int, free: int = 64, wait_s: float = 0.03, cost_s: float | None = None) -> bool:
        state = SimpleNamespace(admit_wait_s=wait_s, pool=SimpleNamespace(live=dict.fromkeys(range(live))),
                                waiting=waiting, admit_cost_s=cost_s)
        return Scheduler._batch_ready(state, free)

    assert ready([sub(1)], live=0)  # idle: at once
    assert ready([sub(1)], live=16, wait_s=0.0)  # no wait set: at once
    assert not ready([sub(1), sub(2)], live=16)  # 3 of the 4 a quarter of 16 rows asks
    assert ready([sub(1), sub(3)], live=16)
    assert ready([sub(2)], live=16, free=2)  # they fill the free slots
    assert ready([sub(1, age_s=0.05)], live=16)  # the oldest waited long enough
    # never longer than an admission has lately cost
    assert not ready([sub(1, age_s=0.015)], live=16) and ready([sub(1, age_s=0.015)], live=16, cost_s=0.01)
    assert not ready([sub(1, age_s=0.015)], live=16, cost_s=0.02)
    assert not ready([sub(1, age_s=0.015)], live=16, cost_s=0.5)  # a slow admission (a graph's capture): the cap
    waiting = [sub(1)]
    time.sleep(0.04)
    assert ready(waiting, live=16)


def test_a_turn_that_fails_outside_admission_and_decode_fails_its_requests_and_the_engine_goes_on(monkeypatch):
    """A failure in the engine thread's loop that neither the admission nor the decode run handles (here the pool's
    shrink after a decode run) fails the requests in flight with the error, instead of a dead engine thread
    leaving them waiting forever; the next request is served by a fresh pool."""
    from rlspec.serve.live import Submission
    from rlspec.serve.pool import RowSampling, ServingPool

    scheduler = _scheduler()
    shrink, broke = ServingPool.shrink, []

    def shrink_once(pool):
        if not broke:
            broke.append(pool)
            raise RuntimeError("injected: the pool's shrink failed")
        return shrink(pool)

    monkeypatch.setattr(ServingPool, "shrink", shrink_once)
    first = scheduler.submit_rows(Submission([[5, 6, 7]], [RowSampling(1, 8)]))
    assert first.done.wait(60), "the request hung: the engine thread died"
    assert isinstance(first.error, RuntimeError) and "injected" in str(first.error)
    assert scheduler.stats["engine_errors"] == 1
    second = scheduler.submit_rows(Submission([[5, 6, 7]], [RowSampling(1, 8)]))
    assert second.done.wait(60) and second.error is None and len(second.ids[0]) == 8
    assert scheduler.pool is not broke[0]
    # through the routes: a 500 naming the error (it was a bare "Internal Server Error"), then served again
    from fastapi.testclient import TestClient

    from rlspec.serve.app import build_app

    broke.clear()
    with TestClient(build_app(scheduler.host, "tok"), raise_server_exceptions=False) as http:
        body, auth = {"model": MODEL, "prompt": "ab=", "max_tokens": 5}, {"Authorization": "Bearer tok"}
        failed = http.post("/v1/completions", json=body, headers=auth)
        assert failed.status_code == 500 and "injected: the pool's shrink failed" in failed.json()["error"]["message"]
        assert http.post("/v1/completions", json=body, headers=auth).status_code == 200
        assert http.get("/health", headers=auth).json()["scheduler"]["engine_errors"] == 2


def test_a_decode_run_wakes_each_event_loop_once_and_an_unstreamed_reply_only_at_its_end():
    """Each decode run's tokens wake the requests' listeners with one `call_soon_threadsafe` per event loop, not one
    per request (each is a pipe write, and from the engine thread a wait for the interpreter lock); a reply that
    waits for its whole completion (`Submission.wait_async`) is woken once, when its rows have ended."""
    from rlspec.serve.live import Submission
    from rlspec.serve.pool import RowSampling

    scheduler = _scheduler()

    async def serve() -> tuple[int, list[int], int]:
        loop = asyncio.get_running_loop()
        threadsafe, calls = loop.call_soon_threadsafe, []
        loop.call_soon_threadsafe = lambda *a, **k: (calls.append(a), threadsafe(*a, **k))[1]
        subs = [Submission([[5, 6, 7 + i]], [RowSampling(i, 24, greedy=True)]) for i in range(4)]
        streamed = [sub.listen() for sub in subs[:3]]
        wakes = [0, 0, 0]

        async def follow(i: int) -> None:
            while not subs[i].done.is_set():
                await streamed[i].wait()
                streamed[i].clear()
                wakes[i] += 1

        unstreamed, sets = subs[3], []
        waiter = unstreamed.listen(progress=False)
        waiter.set, original = (lambda: (sets.append(1), original())), waiter.set
        for sub in subs:
            scheduler.submit_rows(sub)
        await asyncio.gather(*(follow(i) for i in range(3)), unstreamed.wait_async())
        return len(calls), wakes, len(sets)

    calls, wakes, sets = asyncio.run(serve())
    assert sets == 1, "the unstreamed reply's listener was woken before its rows ended"
    assert min(wakes) >= 3, wakes  # the streams saw the tokens come in several decode runs
    assert calls <= scheduler.stats["steps"] + 2, (calls, scheduler.stats["steps"])  # not one per request a run


def test_the_engine_thread_is_given_its_engines_cuda_device_by_index():
    """`torch.cuda.set_device` takes no device without an index: the engine thread binds the engine's device by its
    index, "cuda" alone being the creating thread's current one (on CUDA: `test_concurrency_gpu.py`'s engines are
    on "cuda"); nothing off CUDA."""
    from rlspec.serve.scheduler import _cuda_index

    assert _cuda_index(None) is None and _cuda_index("cpu") is None
    assert _cuda_index("cuda:1") == 1 and _cuda_index(torch.device("cuda", 0)) == 0


def test_a_request_that_ends_in_a_decode_run_whose_turn_then_fails_is_still_woken(monkeypatch):
    """A request whose rows all end in a decode run is woken even when the rest of that turn fails (here the pool's
    shrink after the run): its reply is complete, and an async waiter must not wait forever for a wake-up."""
    from rlspec.serve.live import Submission
    from rlspec.serve.pool import RowSampling, ServingPool

    scheduler = _scheduler()

    def shrink_fails(pool):
        raise RuntimeError("injected: the pool's shrink failed")

    monkeypatch.setattr(ServingPool, "shrink", shrink_fails)

    async def one_token() -> Submission:
        sub = scheduler.submit_rows(Submission([[5, 6, 7]], [RowSampling(1, 1)]))
        await asyncio.wait_for(sub.wait_async(), 30)
        return sub

    sub = asyncio.run(one_token())
    assert sub.error is None and len(sub.ids[0]) == 1  # its one token, from the run before the failure
    deadline = time.monotonic() + 10  # the turn's failure is counted just after the wake-up
    while not scheduler.stats["engine_errors"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.stats["engine_errors"] >= 1, "the shrink never failed: the test shows nothing"
