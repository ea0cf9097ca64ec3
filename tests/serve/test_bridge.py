"""Standalone bridge mode end to end: `rlspec run ... hardware.rollout=separate` with a real server process.

Learning equals the colocated run; the server is never left behind; and each failure — a server that never
starts, dies mid-run, or never joins the group, or a trainer killed outright — ends within the stated time.
Cost on 2 busy cores: about 2-3 minutes (each case starts a trainer and a server process).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlspec.runtime.metrics import read_metrics
from tests.conftest import REPO, rlspec_cmd

pytestmark = pytest.mark.distributed

BASE = ("examples/tiny.yaml", "algorithm.steps=3", "hardware.num_threads=1")
BRIDGE = ("hardware.rollout=separate", "sync.method=nccl")
JOINED_TOKEN = "joined-bridge-token-7f3a"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return not _alive(pid)


class Run:
    """`rlspec run` in a subprocess, with its stderr in a file (to read the server's pid while it runs)."""

    def __init__(self, out: Path, *args: str, env: dict | None = None) -> None:
        self.out = out
        self.log = out.parent / f"{out.name}.stderr"
        self.started = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(rlspec_cmd("run", *args, "--out", str(out), "--no-progress"), cwd=REPO,
                                         stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, **(env or {})})

    def stderr(self) -> str:
        return self.log.read_text()

    def server_pid(self, timeout_s: float = 120) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(r"rollout server pid (\d+)", self.stderr())
            if found:
                return int(found.group(1))
            assert self.proc.poll() is None, self.stderr()
            time.sleep(0.1)
        raise AssertionError("no server was started: " + self.stderr())

    def wait(self, timeout_s: float = 300) -> int:
        return self.proc.wait(timeout=timeout_s)

    def wait_for_rows(self, n: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            path = self.out / "metrics.jsonl"
            if path.exists() and len(path.read_text().splitlines()) >= n:
                return
            assert self.proc.poll() is None, self.stderr()
            time.sleep(0.1)
        raise AssertionError(f"fewer than {n} metrics rows after {timeout_s} s")


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    out = tmp_path_factory.mktemp("colocated") / "out"
    run = Run(out, *BASE, "checkpoint.every_n_steps=1", "checkpoint.keep_last=0")
    assert run.wait() == 0, run.stderr()
    return read_metrics(out / "metrics.jsonl")


def _same_learning(rows, reference) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for got, want in zip(rows, reference):
        assert got["reward/mean"] == want["reward/mean"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-9)


def _server_token(pid: int) -> str:
    """The bridge token a run handed its server (from the server's environment)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return env[b"RLSPEC_SERVE_TOKEN"].decode()


def _assert_token_nowhere(token: str, *texts: str, out: Path) -> None:
    assert len(token) >= 6
    for i, text in enumerate(texts):
        assert token not in text, f"the bridge token is in output {i}"
    for path in out.rglob("*"):
        if path.is_file() and path.suffix in ("", ".log", ".json", ".jsonl", ".yaml", ".txt"):
            assert token not in path.read_text(errors="replace"), f"the bridge token is in {path}"


def test_bridge_run_learns_like_colocated_and_leaves_no_server(colocated, tmp_path):
    run = Run(tmp_path / "out", *BASE, *BRIDGE, "checkpoint.every_n_steps=1", "checkpoint.keep_last=0")
    pid = run.server_pid()
    token = _server_token(pid)
    server_log = re.search(r"rollout server pid \d+ at \S+ \(log (\S+)\)", run.stderr()).group(1)
    run.wait_for_rows(1)
    logged = Path(server_log).read_text(errors="replace")  # removed when the run stops its server
    assert run.wait() == 0, run.stderr()
    _assert_token_nowhere(token, run.stderr(), logged, out=tmp_path / "out")
    assert _gone_within(pid, 1.0), "the rollout server outlived the run"
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    _same_learning(rows, colocated)
    assert all(r["sync/bytes"] > 0 and r["sync/gb_per_s"] > 0 for r in rows)


def test_server_killed_mid_run_ends_the_run_naming_server_and_transport(tmp_path):
    run = Run(tmp_path / "out", "examples/tiny.yaml", "algorithm.steps=500", *BRIDGE, "sync.timeout_s=10",
              "rollout.server_reconnect_s=0")
    pid = run.server_pid()
    run.wait_for_rows(1)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    assert run.wait(60) == 1
    assert time.monotonic() - killed < 10 + 5, "the failure was not reported within sync.timeout_s"
    err = run.stderr()
    assert "rollout server at http://127.0.0.1" in err and "sync.method=nccl" in err and "exited with code -9" in err, err


def test_killed_trainer_takes_its_server_down(tmp_path):
    run = Run(tmp_path / "out", "examples/tiny.yaml", "algorithm.steps=500", *BRIDGE)
    pid = run.server_pid()
    run.wait_for_rows(1)
    run.proc.kill()  # SIGKILL: no handler in the trainer runs
    run.wait(10)
    assert _gone_within(pid, 5.0), "the rollout server outlived its killed trainer"


def test_server_that_never_becomes_healthy_fails_within_the_timeout(tmp_path):
    run = Run(tmp_path / "out", *BASE, *BRIDGE, "rollout.server_start_timeout_s=4",
              env={"RLSPEC_SERVE_FAULT": "hang_start"})
    pid = run.server_pid()
    started = time.monotonic()
    assert run.wait(120) == 1
    assert time.monotonic() - started < 4 + 15
    assert "did not become healthy within 4 s" in run.stderr(), run.stderr()
    assert _gone_within(pid, 1.0)


def test_peer_that_never_joins_the_group_fails_within_the_timeout(tmp_path):
    run = Run(tmp_path / "out", *BASE, *BRIDGE, "sync.timeout_s=4",
              env={"RLSPEC_SERVE_FAULT": "skip:CollectiveTransport.join_receiver"})
    pid = run.server_pid()
    assert run.wait(180) == 1
    err = run.stderr()
    assert "sync.method=nccl: rendezvous" in err and "sync.timeout_s=4" in err and "peer: rollout server" in err, err
    assert _gone_within(pid, 1.0)


def test_joined_server_survives_a_trainer_restart_and_a_resumed_run_pushes_first(colocated, tmp_path):
    import httpx

    from rlspec.serve import TOKEN_ENV
    from rlspec.serve.process import free_port

    port = free_port()
    env = {**os.environ, TOKEN_ENV: JOINED_TOKEN}
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(rlspec_cmd("serve", *BASE, "--port", str(port)), cwd=REPO, env=env,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        joined = (*BASE, *BRIDGE, f"rollout.server_url={url}", "checkpoint.every_n_steps=1", "checkpoint.keep_last=0")
        first = Run(tmp_path / "first", *joined, env={TOKEN_ENV: JOINED_TOKEN})
        assert first.wait() == 0, first.stderr()
        _assert_token_nowhere(JOINED_TOKEN, first.stderr(), (tmp_path / "server.log").read_text(), out=tmp_path / "first")
        assert server.poll() is None, "the joined server exited with its trainer"
        assert httpx.get(f"{url}/health").json()["weight_version"] == 3
        _same_learning(read_metrics(tmp_path / "first" / "metrics.jsonl"), colocated)
        # The server now holds step 3's weights. Resume from step 1's checkpoint: unless the run pushes
        # its weights before the first rollout, step 2 samples from the wrong policy.
        shutil.copytree(tmp_path / "first", tmp_path / "resumed")
        shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_000002")
        resumed = Run(tmp_path / "resumed", *joined, "--resume", env={TOKEN_ENV: JOINED_TOKEN})
        assert resumed.wait() == 0, resumed.stderr()
        _same_learning(read_metrics(tmp_path / "resumed" / "metrics.jsonl"), colocated)
        assert httpx.get(f"{url}/health").json()["weight_version"] == 3
        wrong = Run(tmp_path / "wrong", *joined, env={TOKEN_ENV: "other"})
        assert wrong.wait() == 1 and "bridge token" in wrong.stderr()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_a_prompt_over_max_prompt_tokens_through_the_server_exits_2_naming_the_key(tmp_path):
    run = Run(tmp_path / "out", *BASE, *BRIDGE, "rollout.max_prompt_tokens=1")  # copy_char prompts have 2
    assert run.wait() == 2, run.stderr()
    assert "rollout.max_prompt_tokens" in run.stderr() and "raise rollout.max_prompt_tokens" in run.stderr()


def test_a_server_killed_mid_run_is_restarted_and_the_run_learns_as_if_nothing_happened(colocated, tmp_path):
    """The run's own server is SIGKILLed between steps (the trainer paused meanwhile, so the loss lands mid-run):
    the trainer starts a new one, pushes its weights, re-runs the interrupted requests, and every row equals the
    colocated run's."""
    run = Run(tmp_path / "out", *BASE, *BRIDGE, "sync.timeout_s=10", "rollout.server_reconnect_s=120")
    pid = run.server_pid()
    run.wait_for_rows(1)
    run.proc.send_signal(signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        assert _gone_within(pid, 5.0)
    finally:
        run.proc.send_signal(signal.SIGCONT)
    assert run.wait() == 0, run.stderr()
    err = run.stderr()
    assert "was lost; waiting up to 120 s" in err and "is back after" in err, err
    assert len(re.findall(r"rollout server pid (\d+)", err)) == 2, err
    _same_learning(read_metrics(tmp_path / "out" / "metrics.jsonl"), colocated)


@pytest.mark.slow  # the detection and the restart decision run in CI without processes (tests/serve/test_reconnect.py)
def test_a_stopped_server_the_run_started_is_detected_and_restarted(colocated, tmp_path):
    """The run's own server is stopped (SIGSTOP: alive, holding its port and connections, answering nothing) between
    steps: the request to it times out (rollout.request_timeout_s), a health check gets no answer, and the trainer
    kills it, starts a new one, pushes its weights and re-runs the step; every row equals the colocated run's."""
    run = Run(tmp_path / "out", *BASE, *BRIDGE, "sync.timeout_s=10", "rollout.request_timeout_s=5",
              "rollout.server_reconnect_s=120")
    pid = run.server_pid()
    run.wait_for_rows(1)
    run.proc.send_signal(signal.SIGSTOP)
    try:
        os.killpg(pid, signal.SIGSTOP)  # the server and any process of its own
        stopped = time.monotonic()
    finally:
        run.proc.send_signal(signal.SIGCONT)
    try:
        deadline = time.monotonic() + 120
        while "was lost; waiting up to 120 s" not in run.stderr():
            assert run.proc.poll() is None and time.monotonic() < deadline, run.stderr()
            time.sleep(0.1)
        detected_s = time.monotonic() - stopped
        assert run.wait() == 0, run.stderr()
    finally:
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
    err = run.stderr()
    print(f"\nstopped server: detected {detected_s:.1f} s after SIGSTOP; "
          f"{[line for line in err.splitlines() if 'stopped answering' in line or 'is back' in line]}")
    assert "stopped answering" in err or "a health check did not answer within 5 s" in err, err  # a request's, a push's
    assert "is back after" in err and not _alive(pid), err
    assert detected_s < 10 + 5 + 15  # the longer of request_timeout_s and sync.timeout_s, a health check, slack
    assert len(re.findall(r"rollout server pid (\d+)", err)) == 2, err
    _same_learning(read_metrics(tmp_path / "out" / "metrics.jsonl"), colocated)


def _start_server(port: int, log_path: Path) -> subprocess.Popen:
    from rlspec.serve import TOKEN_ENV

    with open(log_path, "a") as log:
        return subprocess.Popen(rlspec_cmd("serve", *BASE, "--port", str(port)), cwd=REPO,
                                env={**os.environ, TOKEN_ENV: JOINED_TOKEN}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _kill(server: subprocess.Popen) -> None:
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait()


@pytest.mark.slow  # a server killed mid-run (started by the run) and a joined server outliving its trainer run in CI
def test_a_joined_server_killed_and_restarted_mid_run_is_waited_for_and_the_run_learns_as_before(colocated, tmp_path):
    from rlspec.serve import TOKEN_ENV
    from rlspec.serve.process import free_port

    port = free_port()
    server = _start_server(port, tmp_path / "server.log")
    try:
        run = Run(tmp_path / "out", *BASE, *BRIDGE, f"rollout.server_url=http://127.0.0.1:{port}", "sync.timeout_s=10",
                  "rollout.server_reconnect_s=120", env={TOKEN_ENV: JOINED_TOKEN})
        run.wait_for_rows(1)
        run.proc.send_signal(signal.SIGSTOP)  # so that the loss lands mid-run however fast the steps are
        try:
            _kill(server)
        finally:
            run.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 120
        while "was lost; waiting up to 120 s" not in run.stderr():
            assert run.proc.poll() is None and time.monotonic() < deadline, run.stderr()
            time.sleep(0.1)
        server = _start_server(port, tmp_path / "server.log")  # its operator restarts it, on the same address
        assert run.wait() == 0, run.stderr()
        assert "is back after" in run.stderr(), run.stderr()
        _same_learning(read_metrics(tmp_path / "out" / "metrics.jsonl"), colocated)
    finally:
        _kill(server)


@pytest.mark.slow  # the deadline logic is also tested without processes (tests/serve/test_reconnect.py)
def test_a_server_that_stays_away_past_server_reconnect_s_fails_the_run(tmp_path):
    from rlspec.serve import TOKEN_ENV
    from rlspec.serve.process import free_port

    port = free_port()
    server = _start_server(port, tmp_path / "server.log")
    try:
        run = Run(tmp_path / "out", "examples/tiny.yaml", "algorithm.steps=500", "hardware.num_threads=1", *BRIDGE,
                  f"rollout.server_url=http://127.0.0.1:{port}", "sync.timeout_s=10", "rollout.server_reconnect_s=3",
                  env={TOKEN_ENV: JOINED_TOKEN})
        run.wait_for_rows(1)
    finally:
        _kill(server)
    killed = time.monotonic()
    assert run.wait(120) == 1, run.stderr()
    assert time.monotonic() - killed < 3 + 10 + 15
    err = run.stderr()
    assert "is not back within rollout.server_reconnect_s=3" in err, err
