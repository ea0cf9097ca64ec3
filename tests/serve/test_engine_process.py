"""`rlspec serve --engine-process on` on CPU: the engine in a process of its own behind the HTTP process gives every
request exactly what the one-process server gives it (alone and all together, streamed or not), frees a gone
client's rows, keeps the queue's bound (429), runs the bridge and labels there, and stops the server when the engine
process dies, failing the requests in flight."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.serve.test_concurrency import MODEL, REQUESTS, _send, _summary, flood_past_the_bound, leave_mid_stream

TOKEN = "tok"


@pytest.fixture(scope="module")
def servers():
    """(url of the engine-process server, its host, url of a one-process server of the same plan, calls of on_exit)."""
    from rlspec.plan import build_plan
    from rlspec.serve.app import EngineHost, build_app
    from rlspec.serve.engine_process import RemoteHost
    from rlspec.serve.process import build_engine
    from tests.serve.web import serving

    plan, _ = build_plan("examples/tiny.yaml", ["rollout.max_new_tokens=32", "rollout.decode_slots=8",
                                                "hardware.num_threads=1"], None)
    exits: list[str] = []
    remote = RemoteHost(build_engine, plan, 0, MODEL, 8192, 0.0005, on_exit=exits.append, warm_pool=True)
    local = EngineHost(build_engine(plan), MODEL)  # not warmed: a warmed pool samples what a cold one does
    try:
        with serving(build_app(remote, TOKEN)) as url, serving(build_app(local, TOKEN)) as local_url:
            yield url, remote, local_url, exits
    finally:
        remote.stop()


def test_requests_get_what_the_one_process_server_gives_alone_and_together(servers):
    import httpx

    url, host, local_url, _ = servers
    requests = [(route, dict(body)) for route, body in REQUESTS]
    requests[4][1]["stop"] = ["q", "\n"]

    async def both():
        async with httpx.AsyncClient(base_url=local_url, timeout=120, trust_env=False) as http:
            reference = [await _send(http, route, body) for route, body in requests]
        async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:
            alone = [await _send(http, route, body) for route, body in requests]
            together = await asyncio.gather(*(_send(http, route, body) for route, body in requests))
        return reference, alone, together

    reference, alone, together = asyncio.run(both())
    for (route, body), ref, a, b in zip(requests, reference, alone, together):
        assert _summary(a) == _summary(ref), (route, body)  # token for token, log-probs to the bit
        assert _summary(b) == _summary(ref), (route, body)
    assert host.warmed == (0, 0.0), host.warmed  # warmed at start; on CPU there is no step to capture
    state = host.state()["scheduler"]
    assert state["batching"] == "continuous" and state["max_rows_in_flight"] > 4, state
    assert state["rows_queued"] == 0 and state["rows_in_flight"] == 0, state
    assert all(o.get("weight_version", 0) == 0 for o in together if not o.get("streamed"))


def test_a_gone_client_frees_its_rows_and_past_the_bound_requests_get_429(servers):
    import httpx

    url, host, _, _ = servers
    before = host.state()["scheduler"]["rows_cancelled"]
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        leave_mid_stream(http)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = host.state()["scheduler"]
        if state["rows_in_flight"] == 0 and state["rows_cancelled"] >= before + 3:
            break
        time.sleep(0.05)
    assert state["rows_in_flight"] == 0 and state["rows_cancelled"] >= before + 3, state

    host.thread.max_queued_rows = 8  # 8 slots decode, 8 rows wait, the rest are refused
    try:
        flood_past_the_bound(url, {"model": MODEL, "prompt": "ab=", "n": 4, "max_tokens": 24, "logprobs": 0}, 60)
    finally:
        host.thread.max_queued_rows = 8192
    assert host.thread.queued_rows == 0


def test_an_aborted_request_that_runs_alone_stops_in_the_engine_process(servers):
    """A request sampled alone (a model the slot pool cannot run) whose client went away: the abort crosses the
    pipe and the engine's plain loop stops at its next token (greedy, this prompt runs 400 tokens uncut: ~0.4 s on
    an idle CPU host, so the abort comes 50 ms after the request, not later)."""
    from rlspec.rollout.sampling import SampleOptions
    from rlspec.serve.live import Abort

    _, host, _, _ = servers
    before = host.state()["scheduler"]["rows_cancelled"]

    async def started_then_aborted():
        abort = Abort()
        job = asyncio.ensure_future(host.generate_alone(
            [[5, 6, 7]], 1, 0, {"max_new_tokens": 400, "temperature": 1.0, "top_p": 1.0},
            SampleOptions(greedy=True), 0, abort=abort))
        await asyncio.sleep(0.05)
        abort.set()
        return await asyncio.wait_for(job, 60)

    _, rollout = asyncio.run(started_then_aborted())
    assert rollout is None or len(rollout.completion_ids[0]) < 400  # not started, or stopped mid-way
    assert host.state()["scheduler"]["rows_cancelled"] == before + 1


def test_bridge_operations_and_labels_run_in_the_engine_process(servers):
    import httpx
    import torch

    from rlspec.serve import ops

    url, host, _, _ = servers
    auth = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        def call(op: str, value=None, **header):
            response = http.post("/bridge/receive", content=ops.pack({"op": op, **header}, value), headers=auth)
            assert response.status_code == 200, response.text
            if response.headers["content-type"].startswith("application/json"):
                return response.json()["result"]
            return ops.unpack(response.content)[1]

        where = call("engine.describe")
        assert where["thread"] == "rlspec-engine"
        named = call("engine.named_weights")
        norm = next(i for i, (name, _) in enumerate(named) if name.endswith("model.norm.weight"))
        changed = [(name, t + 1 if i == norm else t) for i, (name, t) in enumerate(named)]
        body = {"model": MODEL, "prompt": "ab=", "seed": 3, "max_tokens": 6, "logprobs": 0}
        before = http.post("/v1/completions", json=body).json()
        call("engine.load_weights", changed, weight_version=7)
        assert http.get("/bridge/weight_version").json() == {"weight_version": 7}
        after = http.post("/v1/completions", json=body).json()
        assert after["weight_version"] == 7 and _summary(after) != _summary(before)
        assert torch.equal(dict(call("engine.named_weights"))[named[norm][0]], named[norm][1] + 1)
        call("engine.load_weights", named, weight_version=8)  # as it was
        assert _summary(http.post("/v1/completions", json=body).json()) == _summary(before)
        assert http.post("/bridge/weight_version", json={"version": 9}, headers=auth).json() == {"weight_version": 9}
        assert http.get("/health").json()["weight_version"] == 9
        bad = http.post("/bridge/receive", content=ops.pack({"op": "engine.nothing"}, None), headers=auth)
        assert bad.status_code == 400 and "engine.nothing" in bad.text
        assert http.post("/bridge/receive", content=b"x" * 16).status_code == 401


def test_the_engine_process_dying_fails_the_requests_in_flight_and_stops_the_server(servers):
    """Last in the module: it ends the engine process."""
    import httpx

    url, host, _, exits = servers
    body = {"model": MODEL, "prompt": "ab=", "n": 2, "seed": 1, "max_tokens": 300, "temperature": 0}

    async def killed_mid_request():
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
            pending = asyncio.ensure_future(http.post("/v1/completions", json=body))
            deadline = time.monotonic() + 30
            while not (await asyncio.to_thread(host.state))["scheduler"]["rows_in_flight"]:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            os.kill(host.engine_pid, signal.SIGKILL)
            return await pending

    response = asyncio.run(killed_mid_request())
    assert response.status_code == 500
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits and "engine process" in exits[0] and str(host.engine_pid) in exits[0], exits


def test_rlspec_serve_engine_process_on_serves_and_leaves_no_process_behind():
    """`rlspec serve --engine-process on --warm-pool` as a trainer starts it (`ServerProcess`): it warms its pool,
    serves, names both pids, and `stop()` ends the engine process too; an engine process killed stops its server
    (exit 1, naming it)."""
    import httpx

    from rlspec.plan import build_plan
    from rlspec.serve.client import ServerClient
    from rlspec.serve.process import ServerProcess

    plan, _ = build_plan("examples/tiny.yaml", ["hardware.num_threads=1"], None)
    server = ServerProcess(plan, engine_process="on", warm_pool=True)
    server.start()
    try:
        ServerClient(server.url, server.token, 60, server.describe).wait_healthy(120, server.alive)
        assert "serving pool warmed: 0 graphs" in server.log_path.read_text()  # CPU: none to capture
        out = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab=", "max_tokens": 4, "seed": 1},
                         trust_env=False, timeout=60).json()
        assert len(out["choices"][0]["token_ids"]) >= 1
        log = server.log_path.read_text()
        engine_pid = int(log.split("engine process pid ")[1].split(")")[0])
        os.kill(engine_pid, 0)  # alive while the server is
    finally:
        server.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the engine process {engine_pid} outlived its server")

    server = ServerProcess(plan, engine_process="on")  # and the engine process killed: the server exits 1, saying why
    server.start()
    try:
        ServerClient(server.url, server.token, 60, server.describe).wait_healthy(120, server.alive)
        engine_pid = httpx.get(f"{server.url}/health", trust_env=False, timeout=60).json()["engine_pid"]
        os.kill(engine_pid, signal.SIGKILL)
        assert server.proc.wait(30) == 1
        assert f"the engine process (pid {engine_pid}) exited with code -9" in server.log_path.read_text()
    finally:
        server.stop()


def test_the_pipe_writer_keeps_the_order_batches_what_queued_and_sends_a_body_after_its_message():
    """While a write waits for the reader (a message larger than the pipe's buffer), what is queued behind it goes
    as one batch; a message with a body is written alone, its body right after it; the order is the callers'."""
    import multiprocessing

    from rlspec.serve.engine_process import PipeWriter, received

    ours, theirs = multiprocessing.Pipe()
    writer = PipeWriter(ours, "test-writer")
    writer.send(("big", b"x" * (1 << 20)))  # blocks the writer until we read
    time.sleep(0.2)
    for i in range(50):
        writer.send(("small", i))
    writer.send(("call", 99), body=b"body")
    writer.send(("small", 50))
    time.sleep(0.2)  # everything queued behind the big write
    reads = [theirs.recv() for _ in range(2)]
    assert reads[0][0] == "big"
    assert reads[1][0] == "batch" and [m[1] for m in received(reads[1])] == list(range(50))
    assert theirs.recv() == ("call", 99) and theirs.recv_bytes() == b"body"
    assert received(theirs.recv()) == [("small", 50)]
    writer.close()
    ours.close()


@pytest.mark.parametrize("engine_process,in_flight", [("on", False), pytest.param("off", True, marks=pytest.mark.slow),
                                                      pytest.param("on", True, marks=pytest.mark.slow)])
def test_sigterm_cuts_off_what_is_in_flight_after_the_shutdown_timeout_and_exits(engine_process, in_flight):
    """`rlspec serve --shutdown-timeout-s 1`, SIGTERM idle or while a long stream is in flight: the stream is cut
    off after the timeout and the server (and its engine process: told to stop, not waited out for 10 s while the
    pipe's reader held the pipe open) exits soon after, exit code 143, its token file removed."""
    import subprocess
    import sys
    import threading

    import httpx

    from rlspec.serve.process import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "rlspec.cli", "serve", "examples/tiny.yaml", "--port", str(port),
                             "--engine-process", engine_process, "--shutdown-timeout-s", "1", "hardware.num_threads=1"],
                            env={k: v for k, v in os.environ.items() if not k.startswith("RLSPEC_SERVE_TOKEN")},
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.2)
        started, ended = threading.Event(), []

        def stream():  # 256 rows of 300 tokens: far longer than the timeout on a CPU
            body = {"prompt": "ab=", "n": 256, "max_tokens": 300, "seed": 0, "stream": True}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120, trust_env=False) as out:
                    for _ in out.iter_lines():
                        started.set()
            except httpx.HTTPError as err:
                ended.append(err)
            ended.append("closed")

        reader = threading.Thread(target=stream, daemon=True)
        if in_flight:
            reader.start()
            assert started.wait(120)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        took = time.monotonic() - began
        if in_flight:
            reader.join(10)
            assert ended, "the stream was still open after the server exited"
        assert took < (6 if in_flight else 5), f"{took:.1f} s from SIGTERM to exit with --shutdown-timeout-s 1"
        token_file = proc.stderr.read().decode().split("bridge token written to ")[1].split(" ")[0]
        assert code == 143 and not os.path.exists(token_file)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False
