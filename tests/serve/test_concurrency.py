"""The scheduler on CPU through a real HTTP server: requests in flight together decode in one batch and each gets
exactly its solo result; a client that disconnects mid-stream frees its rows; past the queue's bound, 429 with
Retry-After and every accepted request answered; the server keeps serving after each."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

MODEL = "tiny_qwen2"
USER = [{"role": "user", "content": "abc="}]
REQUESTS = [  # (route, body): sampling settings that differ row by row, streamed and not
    ("completions", {"prompt": ["ab=", "c="], "n": 2, "seed": 3, "max_tokens": 9, "logprobs": 2}),
    ("completions", {"prompt": "hello=", "seed": 4, "max_tokens": 5, "temperature": 0.7, "top_p": 0.8}),
    ("completions", {"prompt": "ab=", "n": 3, "seed": 3, "max_tokens": 12, "stream": True, "logprobs": 0}),
    ("completions", {"prompt": [5, 6, 7, 8], "seed": 9, "max_tokens": 7, "temperature": 0, "logprobs": 3}),
    ("completions", {"prompt": "xyz", "n": 2, "seed": 5, "max_tokens": 16}),  # + a stop string its text holds
    ("chat", {"messages": USER, "n": 2, "seed": 6, "max_tokens": 8, "logprobs": True, "top_logprobs": 2}),
    ("chat", {"messages": USER, "seed": 7, "max_tokens": 10, "stream": True, "temperature": 1.3}),
    ("chat", {"messages": USER, "n": 4, "seed": 8, "max_tokens": 6, "top_p": 0.5}),
]
SOLO_ROWS = max(body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list)
                                    and isinstance(body["prompt"][0], str) else 1) for _, body in REQUESTS)


@pytest.fixture(scope="module")
def server():
    from rlspec.models.factory import load_model, load_tokenizer
    from rlspec.rollout.hf import HFEngine
    from rlspec.serve.app import EngineHost, build_app
    from rlspec.spec import ModelSpec, RolloutSpec
    from tests.serve.web import serving

    spec = ModelSpec()
    engine = HFEngine(load_model(spec, 0).eval().requires_grad_(False), load_tokenizer(spec),
                      RolloutSpec(max_new_tokens=32), "cpu")
    host = EngineHost(engine, MODEL)
    with serving(build_app(host, "tok")) as url:
        yield url, host


async def _send(http, route: str, body: dict) -> dict:
    """The response as one JSON body; a streamed one rebuilt from its chunks (text, token log-probs, finish)."""
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    if not body.get("stream"):
        response = await http.post(path, json={"model": MODEL, **body})
        assert response.status_code == 200, response.text
        return response.json()
    choices: dict[int, dict] = {}
    async with http.stream("POST", path, json={"model": MODEL, **body}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                got = choices.setdefault(c["index"], {"index": c["index"], "text": "", "finish_reason": None, "logprobs": []})
                got["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
                lp = c.get("logprobs")
                if lp:
                    got["logprobs"] += lp["token_logprobs"] if "token_logprobs" in lp else [e["logprob"] for e in lp["content"]]
    return {"choices": [choices[i] for i in sorted(choices)], "streamed": True}


def _summary(out: dict) -> list:
    """Per choice what must match: tokens, log-probs, text, finish reason (a stream: its text, log-probs, finish)."""
    rows = []
    for c in sorted(out["choices"], key=lambda c: c["index"]):
        text = c["text"] if "text" in c else (c.get("message") or {}).get("content")
        if out.get("streamed"):
            rows.append((text, c["logprobs"], c["finish_reason"]))
            continue
        lp = c.get("logprobs")
        logps = None if lp is None else (lp["token_logprobs"] if "token_logprobs" in lp else [e["logprob"] for e in lp["content"]])
        rows.append((c["token_ids"], logps, text, c["finish_reason"]))
    return rows


def test_concurrent_requests_each_get_their_solo_result_in_one_decode_batch(server):
    import httpx

    url, host = server
    # The server is the module's: a test that ran before this one on the same worker (xdist's order is not the
    # file's) left its own peak in the counter, which the solo requests below must not be judged by.
    host.thread.stats["max_rows_in_flight"] = 0

    async def solo_then_together():
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
            free = (await _send(http, *REQUESTS[4]))["choices"][0]["text"]
            REQUESTS[4][1]["stop"] = [next(ch for ch in free[2:] if ch.isascii() and ch.isalnum()), "\n"]
            alone = [await _send(http, route, body) for route, body in REQUESTS]
            peak_alone = host.thread.stats["max_rows_in_flight"]
            together = await asyncio.gather(*(_send(http, route, body) for route, body in REQUESTS))
            again = [await _send(http, route, body) for route, body in REQUESTS[:2]]  # still serving, same results
            return alone, peak_alone, together, again

    alone, peak_alone, together, again = asyncio.run(solo_then_together())
    assert peak_alone <= SOLO_ROWS
    for (route, body), a, b in zip(REQUESTS, alone, together):
        assert _summary(a) == _summary(b), (route, body)  # token for token, log-probs to the bit
    assert [_summary(o) for o in again] == [_summary(o) for o in alone[:2]]
    rows = sum(len(o["choices"]) for o in together)
    assert host.thread.stats["max_rows_in_flight"] > SOLO_ROWS, "the requests never decoded in one batch"
    stops = REQUESTS[4][1]["stop"]
    stopped = alone[4]["choices"]
    assert all(not any(stop in c["text"] for stop in stops) for c in stopped)
    assert any(c["finish_reason"] == "stop" for c in stopped), "no row met its stop string: the test shows nothing"
    assert rows == sum(body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list)
                                           and isinstance(body["prompt"][0], str) else 1) for _, body in REQUESTS)


def leave_mid_stream(http) -> None:
    """Stream a request of 3 rows, read one chunk, and go away (greedy: these rows never sample the end token, which
    a seeded draw could, ending them before the client leaves)."""
    body = {"model": MODEL, "prompt": "ab=", "n": 3, "seed": 1, "max_tokens": 300, "stream": True, "temperature": 0}
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break


def test_a_client_that_disconnects_mid_stream_frees_its_rows(server):
    import httpx

    url, host = server
    cancelled = host.thread.stats["rows_cancelled"]
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        leave_mid_stream(http)
        deadline = time.monotonic() + 20
        while host.thread.describe()["rows_in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        health = http.get("/health").json()["scheduler"]
        assert health["rows_in_flight"] == 0, health
        assert host.thread.stats["rows_cancelled"] >= cancelled + 3, host.thread.stats
        out = http.post("/v1/completions", json={"model": MODEL, "prompt": "c=", "max_tokens": 3, "seed": 2})
        assert out.status_code == 200 and len(out.json()["choices"][0]["token_ids"]) >= 1


def test_a_client_that_gives_up_on_an_unstreamed_request_frees_its_rows(server):
    """The server polls a waiting request's connection: a client gone (here: its timeout) cancels the rows."""
    import httpx

    url, host = server
    cancelled = host.thread.stats["rows_cancelled"]
    body = {"model": MODEL, "prompt": "ab=", "n": 3, "seed": 2, "max_tokens": 300, "temperature": 0}
    # the client gives up after 0.1 s: the 300 tokens take ~0.65 s on an idle 2-core host
    with httpx.Client(base_url=url, timeout=0.1, trust_env=False) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body)
    deadline = time.monotonic() + 20
    while host.thread.stats["rows_cancelled"] < cancelled + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host.thread.stats["rows_cancelled"] >= cancelled + 3, host.thread.stats
    assert host.thread.describe()["rows_in_flight"] == 0


def test_a_request_past_the_pools_rows_decodes_beside_the_others(server):
    """A prompt plus max_tokens past the pool's rows (within the model's context) decodes in the long lane: a
    4-token request sent while it runs is answered before it ends, and its tokens are the pool's for the same
    request cut shorter."""
    import httpx

    url, host = server
    scheduler = host.thread
    long_tokens = scheduler.row_budget  # with the prompt's 3 tokens past the pool's rows
    assert long_tokens + 3 <= scheduler.context
    admitted = scheduler.stats["long_rows_admitted"]
    body = {"prompt": [5, 6, 7], "temperature": 0, "logprobs": 0}

    async def long_and_short():
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
            long = asyncio.ensure_future(_send(http, "completions", {**body, "max_tokens": long_tokens}))
            while not scheduler.describe()["long_rows_in_flight"]:
                assert not long.done(), long.result()
                await asyncio.sleep(0.01)
            short = await _send(http, "completions", {**body, "max_tokens": 4})
            assert not long.done(), "the short request waited for the long one"
            return short, await long

    short, long = asyncio.run(long_and_short())
    assert scheduler.stats["long_rows_admitted"] == admitted + 1
    ids = long["choices"][0]["token_ids"]
    assert len(ids) == long_tokens and long["choices"][0]["finish_reason"] == "length"  # greedy: no end token here
    assert ids[:4] == short["choices"][0]["token_ids"]
    assert long["choices"][0]["logprobs"]["token_logprobs"][:4] == \
        pytest.approx(short["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)


def test_a_client_that_leaves_a_long_lane_stream_frees_its_row(server):
    import httpx

    url, host = server
    scheduler = host.thread
    cancelled = scheduler.stats["rows_cancelled"]
    body = {"model": MODEL, "prompt": [5, 6, 7], "temperature": 0, "max_tokens": scheduler.context - 3,
            "stream": True}
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    break  # its row is in the long lane: the client leaves
        deadline = time.monotonic() + 20
        while scheduler.describe()["rows_in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        state = scheduler.describe()
        assert state["rows_in_flight"] == state["rows_queued"] == 0, state
        assert scheduler.stats["rows_cancelled"] == cancelled + 1, scheduler.stats


def test_rows_waiting_for_the_long_lane_count_against_the_queues_bound(server):
    from rlspec.serve.pool import RowSampling
    from rlspec.serve.scheduler import LONG_SLOTS, QueueFull, Submission

    _, host = server
    scheduler = host.thread
    cancelled = scheduler.stats["rows_cancelled"]

    def long(rows: int) -> Submission:
        return Submission([[5, 6, 7]] * rows, [RowSampling(i, scheduler.context - 3, greedy=True) for i in range(rows)])

    scheduler.max_queued_rows = 1
    subs = [scheduler.submit_rows(long(LONG_SLOTS))]  # nothing waits: accepted, and it fills the lane
    try:
        deadline = time.monotonic() + 20
        while scheduler.describe()["long_rows_in_flight"] < LONG_SLOTS and time.monotonic() < deadline:
            time.sleep(0.01)
        subs.append(scheduler.submit_rows(long(1)))  # waits for a slot of the full lane: counted
        assert scheduler.describe()["rows_queued"] == 1
        with pytest.raises(QueueFull, match="--max-queued-rows"):
            scheduler.submit_rows(long(1))
    finally:
        scheduler.max_queued_rows = 8192
        for sub in subs:
            sub.cancel()
    assert all(sub.done.wait(20) for sub in subs)
    assert scheduler.stats["rows_cancelled"] == cancelled + LONG_SLOTS + 1
    assert scheduler.describe()["rows_queued"] == 0


def test_a_client_that_gives_up_on_a_request_that_runs_alone_stops_it(server):
    """A model the slot pool cannot run samples each request alone, as an engine job: a client gone (here: its
    timeout) stops the job at its next token, and its rows are counted as cancelled."""
    import itertools

    import httpx

    from rlspec.rollout.sampling import SampleOptions

    url, host = server
    calls = itertools.count()  # the engine's plain loop asks `stop` before each next token
    cut = host.engine.generate([[5, 6, 7]], 1, seed=0, options=SampleOptions(greedy=True),
                               stop=lambda: next(calls) >= 2)
    assert len(cut.completion_ids[0]) == 3 < host.engine.spec.max_new_tokens
    scheduler = host.thread
    cancelled = scheduler.stats["rows_cancelled"]
    scheduler.pool_reason = "the model is one the slot pool cannot run (this test's)"
    try:
        body = {"model": MODEL, "prompt": [5, 6, 7], "n": 2, "max_tokens": 400, "temperature": 0}
        # the client gives up after 0.1 s: the 400 tokens take ~0.4 s on an idle 2-core host (0.5 s let them finish)
        with httpx.Client(base_url=url, timeout=0.1, trust_env=False) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=body)
        deadline = time.monotonic() + 60
        while scheduler.stats["rows_cancelled"] < cancelled + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scheduler.stats["rows_cancelled"] == cancelled + 2, scheduler.stats
        assert scheduler.run(lambda: "free") == "free" and scheduler.describe()["rows_queued"] == 0
    finally:
        scheduler.pool_reason = None


def flood_past_the_bound(url: str, body: dict, count: int) -> None:
    """`count` requests of `body` (4 rows each, seeds 0..count-1) at once to a server whose queue bound they pass:
    some get 429 with Retry-After naming the flag, the others every row answered in full, and nothing else."""
    import httpx

    async def flood():
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={**body, "seed": s}) for s in range(count)))

    responses = asyncio.run(flood())
    refused = [r for r in responses if r.status_code == 429]
    accepted = [r for r in responses if r.status_code == 200]
    assert len(refused) + len(accepted) == len(responses), {r.status_code for r in responses}
    assert refused and accepted, (len(refused), len(accepted))
    assert all(r.headers["retry-after"] == "1" and "--max-queued-rows" in r.json()["error"]["message"]
               and r.json()["error"]["code"] == "rate_limit_exceeded" for r in refused)  # OpenAI's error object
    for r in accepted:  # nothing accepted is lost: every row answered in full
        choices = r.json()["choices"]
        assert len(choices) == 4 and all(c["token_ids"] and len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"])
                                         for c in choices)


def test_past_the_queue_bound_requests_get_429_and_every_accepted_one_is_answered(server):
    import httpx

    url, host = server
    body = {"model": MODEL, "prompt": "ab=", "n": 4, "max_tokens": 24, "logprobs": 0}
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        assert http.post("/v1/completions", json={**body, "seed": 0}).status_code == 200  # the pool exists
    pool = host.thread.pool
    host.thread.max_queued_rows, pool.max_slots = 8, 8  # two requests decode, two wait, the rest are refused

    try:
        flood_past_the_bound(url, body, 100)
    finally:
        host.thread.max_queued_rows, pool.max_slots = 8192, 256
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        assert http.get("/health").json()["scheduler"]["rows_queued"] == 0
        assert http.post("/v1/completions", json={**body, "seed": 1}).status_code == 200


def test_weights_changed_in_place_between_requests_are_the_ones_sampled(server):
    """A colocated trainer steps the module the agent gateway's engine shares: the next request (the same prompt,
    whose prefill the pool kept) samples the new weights, as a fresh server over them does."""
    import httpx

    from rlspec.serve.app import EngineHost
    from rlspec.serve.openai_api import CompletionRequest, OpenAIRoutes

    url, host = server
    body = {"model": MODEL, "prompt": "ab=", "n": 2, "seed": 21, "max_tokens": 8, "logprobs": 0}
    norm = host.engine.model.model.norm.weight
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        before = _summary(http.post("/v1/completions", json=body).json())
        original = norm.detach().clone()
        try:
            with torch.no_grad():
                norm.add_(torch.randn(norm.shape, generator=torch.Generator().manual_seed(0)))
            after = _summary(http.post("/v1/completions", json=body).json())
            fresh = EngineHost(host.engine, MODEL)  # a pool that never saw the old weights
            reply = OpenAIRoutes(fresh).completion(CompletionRequest(**body))
            assert after == _summary(reply.body()) and after != before
        finally:
            with torch.no_grad():
                norm.copy_(original)
        assert _summary(http.post("/v1/completions", json=body).json()) == before


def test_a_servers_own_engine_refreshes_after_a_job_not_at_every_burst(server):
    """`rlspec serve`'s engine (`owns_weights`: only the bridge's jobs write it): a job that writes the weights in
    place is seen by the next request (the same prompt, whose prefill the pool kept), as by a fresh server; with no
    job between requests the pool's derived copies are not rebuilt."""
    from rlspec.serve.app import EngineHost
    from rlspec.serve.openai_api import CompletionRequest, OpenAIRoutes

    _, shared = server
    host = EngineHost(shared.engine, MODEL, owns_weights=True)
    routes = OpenAIRoutes(host)
    body = {"model": MODEL, "prompt": "ab=", "n": 2, "seed": 21, "max_tokens": 8, "logprobs": 0}
    norm = host.engine.model.model.norm.weight
    original = norm.detach().clone()

    def ask():
        return _summary(routes.completion(CompletionRequest(**body)).body())

    before = ask()
    refreshes = []
    pool = host.thread.pool
    refresh = pool.refresh_weights
    pool.refresh_weights = lambda: (refreshes.append(1), refresh())[1]
    try:
        assert ask() == before and not refreshes, "no job ran: nothing to refresh"
        delta = torch.randn(norm.shape, generator=torch.Generator().manual_seed(0))
        host.thread.run(lambda: norm.data.add_(delta))  # a push: a job on the engine thread
        after = ask()
        assert refreshes and after != before
        fresh = OpenAIRoutes(EngineHost(host.engine, MODEL))  # a pool that never saw the old weights
        assert after == _summary(fresh.completion(CompletionRequest(**body)).body())
    finally:
        host.thread.run(lambda: norm.data.copy_(original))
    assert ask() == before


def test_requests_waiting_together_start_in_one_admission(server):
    """Requests queued while the engine thread is busy start in one `ServingPool.admit` (one batched prefill, one
    resize), not one admission each; the engine thread's counters say so."""
    import threading

    from rlspec.serve.pool import RowSampling
    from rlspec.serve.scheduler import Submission

    _, host = server
    scheduler = host.thread
    busy, release = threading.Event(), threading.Event()
    scheduler.submit(lambda: (busy.set(), release.wait(60)))
    assert busy.wait(60)
    before = dict(scheduler.stats)
    subs = [scheduler.submit_rows(Submission(prompt_ids=[[5 + i, 6, 7]], samplings=[RowSampling(key=i, max_tokens=4)]))
            for i in range(5)]
    release.set()
    for sub in subs:
        assert sub.done.wait(60) and sub.error is None
    assert [len(sub.ids[0]) for sub in subs] == [4] * 5
    assert scheduler.stats["rows_admitted"] - before["rows_admitted"] == 5
    assert scheduler.stats["admits"] - before["admits"] == 1
    assert scheduler.stats["admit_s"] > before["admit_s"] and scheduler.stats["decode_s"] > before["decode_s"]


def test_tokens_that_add_no_text_stream_their_logprobs_at_once(server, monkeypatch):
    """A streamed row whose tokens decode to nothing (special tokens; a random model's ids past its tokenizer, as in
    the serving bench) sends their log-probs as they are sampled, in chunks of empty text, not all in its last
    chunk; they join to the unstreamed request's log-probs."""
    import httpx

    import rlspec.serve.live as live

    url, _ = server
    body = {"model": MODEL, "prompt": "ab=", "seed": 11, "max_tokens": 32, "logprobs": 0}  # several wakes on a busy host
    monkeypatch.setattr(live, "decoder", lambda tokenizer: lambda ids: "")

    async def both():
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
            plain = (await http.post("/v1/completions", json=body)).json()
            chunks = []
            async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += json.loads(line[len("data: "):])["choices"]
            return plain, chunks

    plain, chunks = asyncio.run(both())
    carrying = [c["logprobs"]["token_logprobs"] for c in chunks if c.get("logprobs")]
    assert len(carrying) > 1, "every log-prob came in the row's last chunk"
    assert all(c["text"] == "" for c in chunks)
    assert [x for part in carrying for x in part] == plain["choices"][0]["logprobs"]["token_logprobs"]


def test_a_warmed_pool_holds_every_pool_size_before_any_request(server):
    """`rlspec serve --warm-pool`: the pool and each of its sizes are made before traffic (on CUDA each size's decode
    step is captured then; on CPU there is none to capture)."""
    from rlspec.rollout.static import BATCH_BUCKETS

    _, host = server
    assert host.thread.warm_pool() == (0, 0.0)
    pool = host.thread.pool
    assert sorted(pool._pools) == [b for b in BATCH_BUCKETS if pool.floor <= b <= pool.max_slots]


def test_health_reports_the_prefix_caches_counters_and_a_turn_that_extends_a_row_is_a_hit(server, monkeypatch):
    """A second turn sent as the first turn's prompt ids + sampled ids + new ids reuses the kept row's K/V: `/health`
    shows the hit and the tokens reused. (The engine's weights are the server's own, as `rlspec serve`'s: an idle
    pool keeps what it derived from them, kept rows included, until a job.)"""
    import httpx

    url, host = server
    monkeypatch.setattr(host.thread, "owns_weights", True)
    headers = {"authorization": "Bearer tok"}
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as http:
        before = http.get("/health", headers=headers).json()["scheduler"]["prefix_cache"] or {"hits": 0,
                                                                                           "reused_tokens": 0}
        first = http.post("/v1/completions", json={"model": MODEL, "prompt": "hello there=", "max_tokens": 6,
                                                   "seed": 3}).json()["choices"][0]
        turn = first["prompt_token_ids"] + first["token_ids"] + [98, 99]
        second = http.post("/v1/completions", json={"model": MODEL, "prompt": turn, "max_tokens": 2, "seed": 3})
        assert second.status_code == 200, second.text
        after = http.get("/health", headers=headers).json()["scheduler"]["prefix_cache"]
    assert after["hits"] == before["hits"] + 1
    assert after["reused_tokens"] - before["reused_tokens"] >= len(first["prompt_token_ids"])
    assert 0 < after["tokens"] <= after["max_tokens"]
