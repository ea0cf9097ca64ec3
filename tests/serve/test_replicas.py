"""Several rollout servers for the standalone backend (`hardware.num_rollout_engines` > 1, `rollout.server_urls`).

Without processes: the split (whole groups, balanced, each part numbered from its first sample), the requests in
flight together, a lost server's part re-run alone through its own recovery, the transport once per server.
With processes: a run over two servers (nccl, joined through `rollout.server_urls`; checkpoint, started: slow)
learns exactly as one server does, and every server got every push.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest

from rlspec.errors import SpecError
from rlspec.rollout.base import Rollout
from rlspec.runtime.metrics import read_metrics
from rlspec.serve.client import ServedEngine, ServerLost
from rlspec.cluster.dispatch import split_groups
from rlspec.serve.client import ServedReplicas
from rlspec.spec import RolloutSpec
from rlspec.sync.replicas import PerReplica
from tests.conftest import REPO, rlspec_cmd

BASE = ("examples/tiny.yaml", "algorithm.steps=3", "hardware.num_threads=1", "hardware.rollout=separate")
TOKEN = "replicas-bridge-token-5c1d"


def test_groups_are_split_whole_and_balanced():
    assert split_groups(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_groups(8, 2) == [range(0, 4), range(4, 8)]
    assert split_groups(1, 3) == [range(0, 1), range(1, 1), range(1, 1)]
    for groups, parts in ((64, 2), (13, 4), (5, 5)):
        sizes = [len(p) for p in split_groups(groups, parts)]
        assert sum(sizes) == groups and max(sizes) - min(sizes) <= 1


class _Replica:
    """A `ServedEngine` stand-in that records its requests; `meet` makes each request wait for the other's."""

    def __init__(self, index: int, meet: threading.Barrier | None = None) -> None:
        self.index, self.meet, self.requests = index, meet, []
        self.starts_in_sync = True
        self.client = self  # `ServedReplicas.close` closes each replica's client

    def close(self) -> None:
        pass

    def generate(self, prompts, n, seed, first_sample=0):
        self.requests.append((list(prompts), n, seed, first_sample))
        if self.meet is not None:
            self.meet.wait(timeout=5)  # breaks (fails the test) unless both requests are in flight at once
        rows = [(p, first_sample + k) for k, p in enumerate(x for x in prompts for _ in range(n))]
        return Rollout([[0]] * len(rows), [[i] for _, i in rows], [[-1.0]] * len(rows), [f"{p}:{i}" for p, i in rows])


def test_each_server_gets_its_groups_numbered_from_its_first_sample_all_at_once():
    meet = threading.Barrier(2)
    replicas = [_Replica(0, meet), _Replica(1, meet)]
    engine = ServedReplicas(replicas, tokenizer=None, dispatch="split")
    try:
        out = engine.generate(["a", "b", "c"], n=2, seed=9)
    finally:
        engine.close()
    assert replicas[0].requests == [(["a", "b"], 2, 9, 0)]
    assert replicas[1].requests == [(["c"], 2, 9, 4)]
    assert out.texts == ["a:0", "a:1", "b:2", "b:3", "c:4", "c:5"]  # the step's order, each sample its own number
    assert engine.metrics()["rollout/samples_replica_0"] == 4.0 and engine.metrics()["rollout/samples_replica_1"] == 2.0


class _LosingClient:
    """A server that is lost for its first completions request, then back (after `wait_healthy`)."""

    def __init__(self, url: str, lose: bool) -> None:
        self.url, self.label, self.lost, self.calls = url, f"rollout server at {url}", lose, 0

    def completions(self, body, timeout_s=None):
        self.calls += 1
        if self.lost:
            raise ServerLost(f"{self.label} is unreachable during a completions request")
        first = body["first_sample"]
        count = len(body["prompt"]) * body["n"]
        return {"choices": [{"index": i, "prompt_token_ids": [1], "token_ids": [first + i],
                             "logprobs": {"token_logprobs": [-0.5]}, "text": str(first + i)} for i in range(count)]}

    def wait_healthy(self, timeout_s, alive=lambda: True):
        self.lost = False
        return {}

    def close(self):
        pass


def test_a_lost_server_recovers_alone_and_reruns_only_its_part():
    clients = [_LosingClient("http://a", lose=False), _LosingClient("http://b", lose=True)]
    restarted, resynced = [], []
    replicas = []
    for i, client in enumerate(clients):
        replica = ServedEngine(client, None, RolloutSpec(), starts_in_sync=True, reconnect_s=5.0,
                               restart=lambda i=i: restarted.append(i))
        replica.resync = lambda i=i: resynced.append(i)
        replicas.append(replica)
    engine = ServedReplicas(replicas, tokenizer=None, dispatch="split")
    try:
        out = engine.generate(["p", "q", "r", "s"], n=2, seed=1)
    finally:
        engine.close()
    assert out.texts == [str(i) for i in range(8)]
    assert restarted == [1] and resynced == [1], "only the lost server is restarted and re-pushed"
    assert clients[0].calls == 1 and clients[1].calls == 2, "only the lost server's part runs again"


class _Transport:
    name = "fake"

    def __init__(self, log: list) -> None:
        self.log, self.spec = log, None

    def connect(self, engine, weights=None):
        self.log.append(("connect", self, engine))

    def push(self, weights, engine):
        self.log.append(("push", self, engine))
        return 10

    def close(self):
        self.log.append(("close", self, None))


def test_the_transport_runs_once_per_server_and_its_owner_closes_the_first(monkeypatch):
    from rlspec import sync

    log: list = []
    first = _Transport(log)
    monkeypatch.setattr(sync, "build_transport", lambda name, spec: _Transport(log))

    class Engine:
        replicas = ["server0", "server1", "server2"]

    transport = PerReplica(first)
    transport.connect(Engine())
    assert [(what, engine) for what, _, engine in log] == [("connect", "server0"), ("connect", "server1"),
                                                           ("connect", "server2")]
    assert log[0][1] is first and len({id(t) for _, t, _ in log}) == 3
    for _ in range(2):  # the first push one server after another, the next ones at once
        log.clear()
        assert transport.push(None, Engine()) == 30
        assert sorted(engine for _, _, engine in log) == ["server0", "server1", "server2"]
    assert sorted(transport.metrics()) == [f"timing_s/sync_replica_{i}" for i in range(3)]
    assert transport.metrics() == {}, "a step without a push reports no push time"
    built = transport.transports[1:]
    log.clear()
    transport.close()
    assert [t for what, t, _ in log if what == "close"] == built, "it closes what it built, not the first"


@pytest.mark.parametrize("overrides, key", [
    (("hardware.num_rollout_engines=2",), "hardware.num_rollout_engines"),  # colocated
    (("hardware.rollout=separate", "hardware.num_rollout_engines=2", "sync.method=cuda_ipc"), "sync.method"),
    (("hardware.rollout=separate", "rollout.server_urls=[http://a:1,ftp://b:2]", "hardware.num_rollout_engines=2"),
     "rollout.server_urls[1]"),
    (("hardware.rollout=separate", "rollout.server_urls=[http://a:1,http://b:2]"), "hardware.num_rollout_engines"),
    (("hardware.rollout=separate", "hardware.num_rollout_engines=2", "rollout.server_url=http://a:1"),
     "rollout.server_url"),
    (("rollout.server_urls=[http://a:1]",), "rollout.server_urls"),  # colocated
])
def test_combinations_that_cannot_work_name_the_key(overrides, key):
    from rlspec.run import build_plan

    with pytest.raises(SpecError) as err:
        build_plan("examples/tiny.yaml", overrides, "standalone")
    assert err.value.where == key, str(err.value)


def test_a_listed_server_that_never_answers_is_bad_input_naming_its_entry(tmp_path):
    from rlspec.serve.process import free_port

    urls = f"[http://127.0.0.1:{free_port()},http://127.0.0.1:{free_port()}]"  # nothing listens there
    done = _run(tmp_path / "out", "hardware.num_rollout_engines=2", f"rollout.server_urls={urls}",
                "rollout.server_start_timeout_s=0.5")
    assert done.returncode == 2, done.stderr
    assert "rollout.server_urls[0]: no healthy rollout server at http://127.0.0.1:" in done.stderr, done.stderr
    assert "start `rlspec serve` there first, or fix the URL" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists(), "bad input leaves nothing behind"


def _serve(port: int, log_path) -> subprocess.Popen:
    from rlspec.serve import TOKEN_ENV

    with open(log_path, "a") as log:
        return subprocess.Popen(rlspec_cmd("serve", *BASE, "--port", str(port)), cwd=REPO,
                                env={**os.environ, TOKEN_ENV: TOKEN}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _run(out, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(rlspec_cmd("run", *BASE, *args, "--out", str(out), "--no-progress"), cwd=REPO,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=600)


def _same_rows(rows: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for got, want in zip(rows, reference):
        assert got["reward/mean"] == want["reward/mean"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-9)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


@pytest.fixture(scope="module")
def one_server(tmp_path_factory):
    """The reference: the same run over one started server (nccl)."""
    out = tmp_path_factory.mktemp("one") / "out"
    done = _run(out, "sync.method=nccl")
    assert done.returncode == 0, done.stderr
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.distributed
def test_two_joined_servers_learn_as_one_server_and_both_get_every_push(one_server, tmp_path):
    import httpx

    from rlspec.serve import TOKEN_ENV
    from rlspec.serve.process import free_port

    ports = [free_port(), free_port()]
    servers = [_serve(port, tmp_path / f"server{i}.log") for i, port in enumerate(ports)]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        # by work (rollout.dispatch=queue, one prompt a chunk): the servers take chunks as they free, and the run
        # learns what one server's does
        done = _run(tmp_path / "out", "sync.method=nccl", "hardware.num_rollout_engines=2",
                    f"rollout.server_urls=[{','.join(urls)}]", "rollout.dispatch=queue",
                    "rollout.dispatch_chunk_prompts=1", env={TOKEN_ENV: TOKEN})
        assert done.returncode == 0, done.stderr
        rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
        _same_rows(rows, one_server)
        assert [httpx.get(f"{url}/health").json()["weight_version"] for url in urls] == [3, 3]
        for row in rows:
            assert row["rollout/samples_replica_0"] > 0 and row["rollout/samples_replica_1"] > 0
            assert row["rollout/samples_replica_0"] + row["rollout/samples_replica_1"] == 8 * 8  # the tiny spec's
            assert 0 < row["timing_s/sync_replica_0"] <= row["timing_s/sync"]
            assert 0 < row["timing_s/sync_replica_1"] <= row["timing_s/sync"]
    finally:
        for server in servers:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.mark.distributed
@pytest.mark.slow  # the split and the push per server are covered by the nccl case above
def test_two_started_servers_with_checkpoint_learn_as_one_server(one_server, tmp_path):
    done = _run(tmp_path / "out", "sync.method=checkpoint", "hardware.num_rollout_engines=2")
    assert done.returncode == 0, done.stderr
    assert len(set(__import__("re").findall(r"rollout server pid (\d+)", done.stderr))) == 2, done.stderr
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    _same_rows(rows, one_server)
    assert all(r["sync/bytes"] > 0 and r["timing_s/sync_replica_1"] > 0 for r in rows)



@pytest.mark.distributed
@pytest.mark.slow  # the recovery of one server among several is tested without processes above
def test_one_of_two_started_servers_killed_mid_run_is_restarted_alone_and_the_run_learns_as_before(one_server, tmp_path):
    import re
    import time

    out, log_path = tmp_path / "out", tmp_path / "run.stderr"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(rlspec_cmd("run", *BASE, "sync.method=nccl", "hardware.num_rollout_engines=2",
                                           "sync.timeout_s=10", "rollout.server_reconnect_s=120", "--out", str(out),
                                           "--no-progress"), cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        pids = [int(p) for p in re.findall(r"rollout server pid (\d+)", log_path.read_text())]
        assert len(pids) == 2
        proc.send_signal(signal.SIGSTOP)  # so that the loss lands mid-run however fast the steps are
        try:
            os.kill(pids[1], signal.SIGKILL)
        finally:
            proc.send_signal(signal.SIGCONT)
        assert proc.wait(timeout=300) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = log_path.read_text()
    assert err.count("was lost; waiting up to 120 s") == 1 and "is back after" in err, err
    assert len(re.findall(r"rollout server pid (\d+)", err)) == 3, "only the lost server is started again"
    _same_rows(read_metrics(out / "metrics.jsonl"), one_server)
