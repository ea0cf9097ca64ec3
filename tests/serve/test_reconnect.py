"""`ServedEngine`'s recovery from a lost server, without processes: a client that fails like a dead server."""

from __future__ import annotations

import threading

import pytest

from rlspec.errors import RunError
from rlspec.serve.client import ServedEngine, ServerLost
from rlspec.spec import RolloutSpec

CHOICE = {"index": 0, "prompt_token_ids": [1], "token_ids": [2], "logprobs": {"token_logprobs": [-0.5]}, "text": "x"}


class _Client:
    """Answers completions once `back` is set; before that every call fails as a dead server does."""

    label = "rollout server at http://test"

    def __init__(self) -> None:
        self.back = threading.Event()
        self.calls = 0
        self.healthy_after_s: float | None = 0.0

    def completions(self, body, timeout_s=None):
        self.calls += 1
        if not self.back.is_set():
            raise ServerLost("rollout server at http://test is unreachable during a completions request")
        return {"choices": [dict(CHOICE, index=i) for i in range(len(body["prompt"]) * body["n"])]}

    def wait_healthy(self, timeout_s, alive=lambda: True):
        if self.healthy_after_s is None or self.healthy_after_s > timeout_s:
            raise RunError(f"did not become healthy within {timeout_s:g} s")
        self.back.set()
        return {}

    def set_weight_version(self, version):
        if not self.back.is_set():
            raise ServerLost("unreachable")


def _engine(client, reconnect_s=5.0, resync=None, restart=None):
    engine = ServedEngine(client, None, RolloutSpec(), starts_in_sync=True, reconnect_s=reconnect_s, restart=restart)
    engine.resync = resync
    return engine


def test_concurrent_requests_lost_together_recover_once_and_are_all_retried():
    client, resyncs, restarts = _Client(), [], []
    engine = _engine(client, resync=lambda: resyncs.append(1), restart=lambda: restarts.append(1))
    barrier, outs, errors = threading.Barrier(8), [], []

    def ask():
        barrier.wait()
        try:
            outs.append(engine.generate(["a", "b"], 2, seed=0))
        except Exception as err:  # noqa: BLE001 - asserted below
            errors.append(err)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(outs) == 8 and all(len(o.completion_ids) == 4 for o in outs)
    assert resyncs == [1] and restarts == [1] and engine.recovery.epoch == 1  # one recovery for all of them


def test_a_server_not_back_in_time_fails_naming_the_setting_and_the_loss():
    client = _Client()
    client.healthy_after_s = None
    with pytest.raises(RunError) as failed:
        _engine(client, reconnect_s=2.0).generate(["a"], 1, seed=0)
    assert "is not back within rollout.server_reconnect_s=2" in str(failed.value)
    assert "unreachable during a completions request" in str(failed.value)


def test_reconnect_s_0_fails_at_once_as_before():
    client = _Client()
    with pytest.raises(ServerLost):
        _engine(client, reconnect_s=0.0).generate(["a"], 1, seed=0)
    assert client.calls == 1 and not client.back.is_set()


def test_a_copy_made_for_other_sampling_settings_shares_the_recovery():
    import copy

    client, resyncs = _Client(), []
    engine = _engine(client, resync=lambda: resyncs.append(1))
    view = copy.copy(engine)  # what the agent gateway does per request
    view.generate(["a"], 1, seed=0)
    assert engine.recovery.epoch == 1 and resyncs == [1]


class _Hung:
    """A server whose process is stopped: the kernel still accepts connections (the listening socket's backlog), and
    nothing ever answers."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def hung(monkeypatch):
    from rlspec.serve import client as client_module

    monkeypatch.setattr(client_module, "HEALTH_PROBE_S", 0.5)
    server = _Hung()
    yield server
    server.close()


def _hung_engine(url: str, joined_as: str | None, restart=None, reconnect_s: float = 5.0) -> ServedEngine:
    from rlspec.serve.client import ServerClient

    client = ServerClient(url, token="t", timeout_s=1.0)
    spec = RolloutSpec(request_timeout_s=1.0)
    return ServedEngine(client, None, spec, starts_in_sync=joined_as is None, reconnect_s=reconnect_s, restart=restart,
                        joined_as=joined_as)


def test_a_stopped_joined_server_fails_the_run_naming_its_key_after_request_timeout_s(hung):
    """A joined server that holds the connection and answers nothing (SIGSTOP): after rollout.request_timeout_s and a
    health check that gets no answer, the run fails naming the spec key of that server, without waiting
    rollout.server_reconnect_s for it (it is not the run's to restart)."""
    import time

    engine = _hung_engine(hung.url, "rollout.server_urls[1]", reconnect_s=60.0)
    started = time.monotonic()
    with pytest.raises(RunError) as failed:
        engine.generate(["a"], 1, seed=0)
    took = time.monotonic() - started
    message = str(failed.value)
    print(f"\nhung joined server: failed after {took:.1f} s: {message}")
    assert message.startswith(f"rollout.server_urls[1]: rollout server at {hung.url} stopped answering")
    assert "a completions request got no answer within 1 s, nor a health check within 0.5 s" in message
    assert "does not restart it" in message and "--resume" in message
    assert took < 1.0 + 0.5 + 3.0  # not rollout.server_reconnect_s
    engine.client.close()


def test_a_stopped_server_the_run_started_is_restarted(hung):
    """The same hang in a server the run started: its restart runs (killing the stopped process) and the request is
    sent again to the new one."""
    restarts = []
    engine = _hung_engine(hung.url, None, restart=lambda: restarts.append(1))
    answers = _Client()
    engine.client.wait_healthy = answers.wait_healthy  # the restarted server: healthy at once, and it answers
    real_completions = engine.client.completions

    def completions(body, timeout_s=None):
        return answers.completions(body, timeout_s) if restarts else real_completions(body, timeout_s)

    engine.client.completions = completions
    out = engine.generate(["a", "b"], 2, seed=0)
    assert restarts == [1] and engine.recovery.epoch == 1 and len(out.completion_ids) == 4
    engine.client.close()


def test_a_slow_request_to_a_server_that_answers_health_checks_is_not_a_hang():
    """A request past its timeout while `/health` still answers: the timeout error as before (no restart)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from rlspec.serve.client import ServerClient, ServerLost

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self):  # /health answers at once
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # a completions request never does
            threading.Event().wait(5)

        def log_message(self, *args):
            pass

    web = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    web.daemon_threads = True
    threading.Thread(target=web.serve_forever, daemon=True).start()
    client = ServerClient(f"http://127.0.0.1:{web.server_address[1]}", token="t", timeout_s=0.5)
    try:
        with pytest.raises(RunError) as failed:
            client.completions({"prompt": ["a"]})
        assert not isinstance(failed.value, ServerLost)
        assert "did not answer within 0.5 s" in str(failed.value) and "still answers health checks" in str(failed.value)
    finally:
        client.close()
        web.shutdown()
