"""The server's HTTP app in-process (FastAPI's TestClient): completions, bad requests, the bridge endpoint."""

from __future__ import annotations

import pickle

import pytest

from rlspec.models.factory import load_model, load_tokenizer
from rlspec.rollout.hf import HFEngine
from rlspec.serve.app import EngineHost, build_app
from rlspec.spec import ModelSpec, RolloutSpec
from rlspec.sync import SyncError

TOKEN = "t0k"


@pytest.fixture(scope="module")
def served():
    from fastapi.testclient import TestClient

    spec = ModelSpec()
    engine = HFEngine(load_model(spec, 0), load_tokenizer(spec), RolloutSpec(max_new_tokens=8), "cpu")
    host = EngineHost(engine, "tiny_qwen2")
    with TestClient(build_app(host, TOKEN)) as client:
        yield client, host, engine


def test_completions_return_the_engines_tokens_and_logprobs(served):
    client, _, engine = served
    body = {"prompt": ["ab=", "c="], "n": 3, "seed": 7, "max_tokens": 6, "temperature": 0.9, "logprobs": 1}
    out = client.post("/v1/completions", json=body)
    assert out.status_code == 200, out.text
    data = out.json()
    assert data["object"] == "text_completion" and data["weight_version"] == 0 and len(data["choices"]) == 6
    from dataclasses import replace

    want = HFEngine(engine.model, engine.tokenizer, replace(engine.spec, max_new_tokens=6, temperature=0.9), "cpu")
    rollout = want.generate(["ab=", "c="], 3, seed=7)
    for i, choice in enumerate(data["choices"]):
        assert choice["index"] == i and choice["token_ids"] == rollout.completion_ids[i]
        assert choice["prompt_token_ids"] == rollout.prompt_ids[i]
        assert choice["logprobs"]["token_logprobs"] == rollout.completion_logprobs[i]  # exact through JSON
        assert choice["text"] == rollout.texts[i] and choice["finish_reason"] in ("stop", "length")
    plain = client.post("/v1/completions", json={"prompt": "ab=", "max_tokens": 2}).json()
    assert plain["choices"][0]["logprobs"] is None and len(plain["choices"][0]["token_ids"]) <= 2


@pytest.mark.parametrize("body,field", [
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "a" * 300}, "prompt"),
    ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "n": "many"}, "n"),
])
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(served, body, field):
    client, _, _ = served
    out = client.post("/v1/completions", json=body)
    assert 400 <= out.status_code < 500, out.text
    assert field in [str(part) for item in out.json()["detail"] for part in item["loc"]], out.text
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["sampler"] == "plain (not on CUDA)"


def _raise(engine, payload):
    raise SyncError(f"boom {payload}")


def _weight_sum(engine, payload):
    return float(sum(t.double().sum() for _, t in engine.named_weights())) + payload


def test_bridge_needs_the_token_runs_engine_halves_and_reports_failures(served):
    client, host, engine = served
    call = pickle.dumps((_weight_sum, 1.0))
    assert client.post("/bridge/receive", content=call).status_code == 401
    assert client.post("/bridge/receive", content=call, headers={"authorization": "Bearer nope"}).status_code == 401
    auth = {"authorization": f"Bearer {TOKEN}"}
    ok = client.post("/bridge/receive", content=call, headers=auth)
    assert ok.status_code == 200 and pickle.loads(ok.content) == pytest.approx(_weight_sum(engine, 1.0))
    assert client.post("/bridge/weight_version", json={"version": 5}, headers=auth).json()["weight_version"] == 5
    failed = client.post("/bridge/receive", content=pickle.dumps((_raise, 3)), headers=auth)
    assert failed.status_code == 500
    report = pickle.loads(failed.content)
    assert report["sync_error"] and "boom 3" in report["error"] and "_raise" in report["traceback"]
    # A failed sync may have written part of the weights: their version is unknown until the next push.
    assert client.get("/health").json()["weight_version"] is None
    assert client.post("/bridge/receive", content=b"junk", headers=auth).status_code == 400
    host.weight_version = 0


def test_a_too_long_prompt_is_bad_input_naming_the_spec_key_on_both_sides(served):
    from rlspec.serve.client import ServedEngine, ServerClient
    from rlspec.spec import SpecError

    client, _, engine = served
    out = client.post("/v1/completions", json={"prompt": "a" * 300})
    assert out.status_code == 400
    detail = out.json()["detail"][0]
    assert detail["loc"] == ["body", "prompt"] and detail["spec_key"] == "rollout.max_prompt_tokens"
    assert "raise rollout.max_prompt_tokens" in detail["fix"]
    remote = ServerClient("http://testserver", TOKEN)
    remote.http = client  # the app in-process, through the trainer's own client code
    served_engine = ServedEngine(remote, engine.tokenizer, engine.spec, starts_in_sync=True)
    with pytest.raises(SpecError) as caught:
        served_engine.generate(["a" * 300], 2, seed=0)
    assert caught.value.where == "rollout.max_prompt_tokens"
    assert "raise rollout.max_prompt_tokens" in caught.value.fix and "rollout server at" in caught.value.problem


def _thread_name(engine, payload):
    import threading

    return threading.current_thread().name


def test_all_engine_work_runs_on_the_one_engine_thread_while_requests_overlap(served):
    from concurrent.futures import ThreadPoolExecutor

    client, _, _ = served
    auth = {"authorization": f"Bearer {TOKEN}"}
    named = client.post("/bridge/receive", content=pickle.dumps((_thread_name, None)), headers=auth)
    assert pickle.loads(named.content) == "rlspec-engine"
    body = {"prompt": ["ab=", "c="], "n": 2, "seed": 3, "max_tokens": 4, "logprobs": 1}
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: client.post("/v1/completions", json=body), range(2)))
    assert all(o.status_code == 200 for o in outs)
    assert outs[0].json()["choices"] == outs[1].json()["choices"]  # same seed, same engine, one at a time
