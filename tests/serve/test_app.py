"""The server's HTTP app in-process (FastAPI's TestClient): completions, bad requests, the bridge endpoint and its
wire format (named operations, JSON + safetensors; a pickle is refused)."""

from __future__ import annotations

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
        # the server decodes in the slot pool (`rlspec.serve.pool`), the engine's plain loop through the HF module: the
        # same tokens, log-probs within fp32 rounding
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(rollout.completion_logprobs[i], abs=1e-5)
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
    ({"prompt": "a", "max_tokens": 600}, "max_tokens"),  # past the model's context (512)
    ({"prompt": "a", "logprobs": True}, "logprobs"),  # chat's boolean: not a count
    ({"prompt": [True, False]}, "prompt"),  # not token ids
])
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(served, body, field):
    client, _, _ = served
    out = client.post("/v1/completions", json=body)
    assert out.status_code == 400, out.text
    assert out.json()["error"]["param"] == field, out.text
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["sampler"] == "plain (not on CUDA)"


def test_a_prompt_plus_max_tokens_past_the_context_or_max_model_len_is_refused_naming_both_numbers(served):
    from rlspec.errors import SpecError
    from rlspec.serve.scheduler import RowQueue

    client, host, engine = served
    context = host.thread.context
    assert host.thread.row_budget < context == 512  # past the pool's rows is served (the long lane), not refused
    prompt = [5, 6, 7]
    out = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": context - 2})
    error = out.json()["error"]
    assert out.status_code == 400 and error["param"] == "max_tokens", out.text
    assert (f"max_tokens={context - 2} and a prompt of 3 tokens make {context + 1} tokens, past the model's context "
            f"of {context} positions; max_tokens can be at most {context - 3}") in error["message"]
    assert "spec_key" not in error  # no spec key raises a model's context
    from fastapi.testclient import TestClient

    with TestClient(build_app(EngineHost(engine, "tiny_qwen2", max_model_len=300), TOKEN)) as limited:
        out = limited.post("/v1/completions", json={"prompt": prompt, "max_tokens": 298})
        error = out.json()["error"]
        assert out.status_code == 400 and error["param"] == "max_tokens", out.text
        assert "make 301 tokens, past this server's limit of 300 tokens a row (rlspec serve --max-model-len)" in \
            error["message"]
    with pytest.raises(SpecError, match="--max-model-len"):
        EngineHost(engine, "tiny_qwen2", max_model_len=context + 1)
    from rlspec.plan import build_plan
    from rlspec.serve.process import serve

    plan, _ = build_plan("examples/tiny.yaml", [], None)
    with pytest.raises(SpecError, match=r"must be 1 to the model's context \(512\), got 513"):
        serve(plan, "127.0.0.1", 1, max_model_len=513)  # before the port is bound or anything is written
    queue = RowQueue()  # neither a context nor --max-model-len known: the pool's rows are the limit
    queue.pool_reason, queue.row_budget, queue.context, queue.max_model_len = None, 384, None, None
    assert queue.token_limit()[0] == 384 and queue.token_limit()[2] == "rollout.max_new_tokens"
    queue.pool_reason = "an engine outside this process"
    assert queue.token_limit()[0] is None


def _client(client):
    """The trainer's own client code, over the app in-process."""
    from fastapi.testclient import TestClient

    from rlspec.serve.client import ServerClient

    class InProcess(TestClient):
        """The app in this process has no network to wait on: the client's per-call timeouts are not passed on
        (Starlette's TestClient warns about them)."""

        def request(self, method, url, timeout=None, **kwargs):
            return super().request(method, url, **kwargs)

    remote = ServerClient("http://testserver", TOKEN)
    remote.http = InProcess(client.app, headers={"authorization": f"Bearer {TOKEN}"})
    return remote


def test_bridge_needs_the_token_runs_named_operations_and_reports_failures(served):
    import torch

    from rlspec.errors import RunError
    from rlspec.serve import ops
    from rlspec.sync.lora import LoraTransport

    client, host, engine = served
    call = ops.pack({"op": "engine.named_weights"}, None)
    assert client.post("/bridge/receive", content=call).status_code == 401
    assert client.post("/bridge/receive", content=call, headers={"authorization": "Bearer nope"}).status_code == 401
    remote = _client(client)
    named = remote.call("engine.named_weights", None)
    own = list(engine.named_weights())
    assert [n for n, _ in named] == [n for n, _ in own] and all(torch.equal(a, b) for (_, a), (_, b) in zip(named, own))
    first, tensor = own[0]
    before = tensor.clone()
    remote.call("engine.load_weights", [(first, before + 1)])
    assert torch.equal(tensor, before + 1)
    remote.call("engine.load_weights", [(first, before)])
    assert remote.call("engine.describe", None)["thread"] == "rlspec-engine"
    assert client.post("/bridge/weight_version", json={"version": 5},
                       headers={"authorization": f"Bearer {TOKEN}"}).json()["weight_version"] == 5
    # A transport's engine half that fails in the server: a SyncError with the server's traceback.
    with pytest.raises(SyncError) as failed:
        remote.receive(LoraTransport.receive, {"tensors": [(first, before)], "expected": None, "bytes": 0})
    assert "lora.receive failed" in str(failed.value) and "server traceback" in str(failed.value)
    # A failed sync may have written part of the weights: their version is unknown until the next push.
    assert client.get("/health").json()["weight_version"] is None
    with pytest.raises(RunError, match="is not a bridge operation"):
        remote.receive(_thread_name, None)  # only the server's own operations can be named
    host.weight_version = 0


def test_a_pickled_body_a_malformed_one_and_an_unknown_operation_are_refused_naming_the_problem(served):
    import pickle

    from rlspec.serve import ops

    client, host, _ = served
    auth = {"authorization": f"Bearer {TOKEN}"}
    ran = []
    for body, words in ((pickle.dumps((print, "pwned")), "pickle"), (pickle.dumps((ran.append, 1), protocol=5), "pickle"),
                        (b"junk not a message", "not a bridge message"), (b"", "empty"),
                        (ops.pack({"op": "os.system"}, "true"), "unknown bridge operation 'os.system'"),
                        (ops.pack({"op": "engine.logprobs"}, {"nope": 1}), "engine.logprobs")):
        out = client.post("/bridge/receive", content=body, headers=auth)
        assert out.status_code == 400, out.text
        assert words in out.json()["detail"][0]["msg"], out.text
    assert not ran and host.weight_version == 0


def test_the_wire_format_round_trips_payloads_and_refuses_what_is_not_data():
    import math

    import torch

    from rlspec.serve import ops

    base = torch.arange(6.0)
    value = {"tensors": [("a", base[:3]), ("b", base[3:])], "expected": {"a": (1.0, float("nan"))}, "n": 3,
             "h": b"\x00\xff", "dtype": torch.bfloat16, "none": None, "size": torch.Size([2, 3]),
             "ints": torch.tensor([1, -2], dtype=torch.int32)}
    header, back = ops.unpack(ops.pack({"op": "x"}, value))
    assert header == {"op": "x"}
    assert back["tensors"][1][0] == "b" and torch.equal(back["tensors"][1][1], base[3:])
    assert isinstance(back["tensors"][0], tuple) and back["size"] == (2, 3) and back["h"] == b"\x00\xff"
    assert back["expected"]["a"][0] == 1.0 and math.isnan(back["expected"]["a"][1])
    assert back["dtype"] is torch.bfloat16 and back["none"] is None and back["ints"].dtype == torch.int32
    for bad in (print, object(), {1: 2}, {"$tensor": "t0"}):
        with pytest.raises(TypeError):
            ops.pack({"op": "x"}, bad)


def test_every_engine_half_the_transports_send_is_an_operation():
    from rlspec.serve import ops
    from rlspec.sync.checkpoint import CheckpointTransport
    from rlspec.sync.collective import CollectiveTransport
    from rlspec.sync.cuda_ipc import CudaIpcTransport
    from rlspec.sync.lora import LoraTransport

    for fn in (CheckpointTransport.receive, LoraTransport.receive, CudaIpcTransport.receive, CudaIpcTransport.forget,
               CollectiveTransport.join_receiver, CollectiveTransport.receive, CollectiveTransport.receive_streamed,
               CollectiveTransport.leave, CollectiveTransport.raw_receive):
        assert ops.operation_for(fn).fn is fn


def test_a_too_long_prompt_is_bad_input_naming_the_spec_key_on_both_sides(served):
    from rlspec.serve.client import ServedEngine
    from rlspec.spec import SpecError

    client, _, engine = served
    out = client.post("/v1/completions", json={"prompt": "a" * 300})
    assert out.status_code == 400
    error = out.json()["error"]
    assert error["param"] == "prompt" and error["spec_key"] == "rollout.max_prompt_tokens"
    assert "raise rollout.max_prompt_tokens" in error["fix"] and error["type"] == "invalid_request_error"
    remote = _client(client)
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
    assert _client(client).call("engine.describe", None)["thread"] == "rlspec-engine"
    body = {"prompt": ["ab=", "c="], "n": 2, "seed": 3, "max_tokens": 4, "logprobs": 1}
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: client.post("/v1/completions", json=body), range(2)))
    assert all(o.status_code == 200 for o in outs)
    assert outs[0].json()["choices"] == outs[1].json()["choices"]  # same seed, same engine, one at a time


def test_no_module_of_the_server_imports_pickle():
    import ast
    from pathlib import Path

    import rlspec.serve

    for path in Path(rlspec.serve.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("pickle", "cloudpickle", "dill") for n in names), path
