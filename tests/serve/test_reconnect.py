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
