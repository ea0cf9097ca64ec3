"""`rlspec.perf.bench_serve`'s burst against a real server: every stream counted, from one client process or spread
over several (the measured streams start together after every client's warm-ups)."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="module")
def url():
    from rlspec.models.factory import load_model, load_tokenizer
    from rlspec.rollout.hf import HFEngine
    from rlspec.serve.app import EngineHost, build_app
    from rlspec.spec import ModelSpec, RolloutSpec
    from tests.serve.web import serving

    spec = ModelSpec()
    engine = HFEngine(load_model(spec, 0).eval().requires_grad_(False), load_tokenizer(spec),
                      RolloutSpec(max_new_tokens=16), "cpu")
    with serving(build_app(EngineHost(engine, "tiny"), "tok")) as address:
        yield address


@pytest.mark.parametrize("clients", [1, 2])
def test_a_burst_counts_every_stream_from_one_or_several_client_processes(url, clients):
    from rlspec.perf.bench_serve import _burst, prompts_for

    prompts = prompts_for(6, 5, 256, 0)
    row = asyncio.run(_burst(url, "completions", prompts, 6, 0, clients))
    assert row["concurrency"] == 6 and row["clients"] == clients
    assert 6 <= row["output_tokens"] <= 36 and row["wall_s"] > 0
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] <= row["wall_s"] * 1e3
    assert row["server_admits"] >= 1 and row["server_steps"] >= 1  # the measured burst's, not the warm-ups'
    assert 0 < row["client_cpu_share"]
