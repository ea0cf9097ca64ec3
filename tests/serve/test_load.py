"""Load: 256 concurrent completion requests to a real HTTP server while the weights are pushed several times.

Every request is the same (prompt, seed), so its tokens and log-probs are a function of the weights alone: each
response must equal, bit for bit, the reference: the same request sent alone to a server holding the weights of the
`weight_version` it reports. A response that
straddled a push, or that reports another version than its weights, would match no reference (the test checks
that the versions' references differ). None may be lost. The p99 latency is printed.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
import torch

REQUESTS = 256
VERSIONS = 6
BODY = {"prompt": ["ab=", "c="], "n": 2, "seed": 11, "max_tokens": 4, "logprobs": 1}
TOKEN = "load-test-token"


PUSHED = "model.norm.weight"
"""The tensor each push changes: a small one, so that a push's body arrives as quickly as a request's."""


def _weights(model, version: int) -> list[tuple[str, torch.Tensor]]:
    """Version `version`'s weights of `PUSHED`: the initial ones plus seeded noise (version 0: unchanged)."""
    gen = torch.Generator().manual_seed(version)
    t = dict(model.named_parameters())[PUSHED].detach()
    return [(PUSHED, t.clone() + (torch.randn(t.shape, generator=gen) if version else 0))]


def versions_range() -> range:
    """The versions pushed during the load (version 0 is the server's initial weights)."""
    return range(1, VERSIONS + 1)


def _choices(out: dict) -> list:
    return [(c["token_ids"], c["prompt_token_ids"], c["logprobs"]["token_logprobs"])
            for c in sorted(out["choices"], key=lambda c: c["index"])]


@pytest.fixture
def server():
    from rlspec.models.factory import load_model, load_tokenizer
    from rlspec.rollout.hf import HFEngine
    from rlspec.serve.app import EngineHost, build_app
    from rlspec.spec import ModelSpec, RolloutSpec
    from tests.serve.web import serving

    spec = ModelSpec()
    engine = HFEngine(load_model(spec, 0).eval().requires_grad_(False), load_tokenizer(spec), RolloutSpec(max_new_tokens=4), "cpu")
    with serving(build_app(EngineHost(engine, "tiny_qwen2"), TOKEN), limit_concurrency=4 * REQUESTS,
                 backlog=4 * REQUESTS) as url:
        yield url, spec


def test_256_concurrent_requests_during_weight_pushes_each_carry_the_version_they_were_sampled_with(server):
    import dataclasses

    import httpx
    from fastapi.testclient import TestClient

    from rlspec.models.factory import load_model, load_tokenizer
    from rlspec.rollout.hf import HFEngine
    from rlspec.serve import ops
    from rlspec.serve.app import EngineHost, build_app
    from rlspec.spec import RolloutSpec

    url, spec = server

    model = load_model(spec, 0).eval().requires_grad_(False)
    versions = [_weights(model, v) for v in range(VERSIONS + 1)]
    rollout_spec = dataclasses.replace(RolloutSpec(), max_new_tokens=BODY["max_tokens"])
    reference = HFEngine(load_model(spec, 0).eval().requires_grad_(False), load_tokenizer(spec), rollout_spec, "cpu")
    expected = {}
    with TestClient(build_app(EngineHost(reference, "tiny_qwen2"), TOKEN)) as solo:  # each version's request alone
        for v, named in enumerate(versions):
            pushed_ok = solo.post("/bridge/receive", content=ops.pack({"op": "engine.load_weights"}, named),
                                  headers={"authorization": f"Bearer {TOKEN}", "content-type": ops.MEDIA_TYPE})
            assert pushed_ok.status_code == 200, pushed_ok.text
            expected[v] = _choices(solo.post("/v1/completions", json=BODY).json())  # floats exact via JSON
    assert len({repr(e) for e in expected.values()}) == len(expected), "two versions sample alike: the test cannot tell them apart"

    pushes = {v: ops.pack({"op": "engine.load_weights", "weight_version": v}, versions[v]) for v in versions_range()}
    auth = {"authorization": f"Bearer {TOKEN}", "content-type": ops.MEDIA_TYPE}
    pushed: list[int] = []

    async def flood() -> list[tuple[float, int, dict]]:
        """All requests in flight at once, launched 1 ms apart, with a push launched after every
        REQUESTS / (VERSIONS + 1) of them: the requests decode in one batch, each push waits for the rows in flight."""
        limits = httpx.Limits(max_connections=2 * REQUESTS, max_keepalive_connections=2 * REQUESTS)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, trust_env=False) as http:
            async def one(delay_s: float):
                await asyncio.sleep(delay_s)
                start = time.perf_counter()
                response = await http.post("/v1/completions", json=BODY)
                return time.perf_counter() - start, response.status_code, response.json()

            async def push(v: int, delay_s: float):
                await asyncio.sleep(delay_s)
                response = await http.post("/bridge/receive", content=pushes[v], headers=auth)
                assert response.status_code == 200, response.text
                pushed.append(v)

            every = REQUESTS // (VERSIONS + 1)
            jobs = [one(i * 1e-3) for i in range(REQUESTS)]
            jobs += [push(v, (v * every) * 1e-3 + 5e-4) for v in versions_range()]
            return (await asyncio.gather(*jobs))[:REQUESTS]

    started = time.perf_counter()
    results = asyncio.run(flood())
    wall_s = time.perf_counter() - started
    assert len(results) == REQUESTS and all(status == 200 for _, status, _ in results), \
        [r for r in results if r[1] != 200][:2]
    seen = [out["weight_version"] for _, _, out in results]
    for out in (o for _, _, o in results):
        assert out["weight_version"] in expected, out["weight_version"]
        assert _choices(out) == expected[out["weight_version"]], f"response {out['id']} does not match version " \
                                                                  f"{out['weight_version']}'s weights"
    assert sorted(pushed) == list(versions_range())
    assert len(set(seen)) >= 3, f"the pushes did not land between the requests (versions seen: {set(seen)})"
    latencies = sorted(s for s, _, _ in results)
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"\nload: {REQUESTS} concurrent requests, {len(pushed)} pushes, versions seen {sorted(set(seen))}; "
          f"wall {wall_s:.2f} s, latency median {statistics.median(latencies) * 1e3:.0f} ms, "
          f"p99 {p99 * 1e3:.0f} ms, max {latencies[-1] * 1e3:.0f} ms")
