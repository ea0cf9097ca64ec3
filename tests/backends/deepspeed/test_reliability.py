"""The deepspeed backend under faults and on two Ray nodes, through the real `rlspec run` entry point.

- A trainer rank made to hang (RLSPEC_FAULT_INJECT mode=hang): the stall detector dumps the stacks of the
  driver and every actor, the run exits 1, and an exception that happened in a worker thread (which Ray
  only writes to the worker's log) is in the run's own log.
- Two nodes: a `ray.cluster_utils.Cluster` of two nodes on this machine (1 CPU each), ranks spread over
  both (`hardware.placement_strategy=SPREAD`), metrics equal to the single-node run (tiny.yaml, 3 steps).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlspec.runtime.metrics import read_metrics

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny.yaml"
SMALL = ["rollout.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=1", "rollout.max_new_tokens=4"]


def rlspec_run(out: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlspec.cli", "run", str(TINY), "--backend", "deepspeed", "--out", str(out),
           "--no-progress", "hardware.num_trainer_ranks=2", *overrides]  # a later ranks override wins
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})})


def test_hanging_rank_trips_the_stall_detector(tmp_path):
    out = tmp_path / "hang"
    start = time.monotonic()
    proc = rlspec_run(out, *SMALL, "algorithm.steps=5", "hardware.stall_timeout_s=20",
                      env={"RLSPEC_FAULT_INJECT": "rank=1,step=1,mode=hang"})
    _, err = proc.communicate(timeout=500)
    took = time.monotonic() - start
    print(f"\nhanging rank: exit {proc.returncode} after {took:.0f} s incl. start-up; "
          f"{[line for line in err.splitlines() if line.startswith('rlspec: run failed')]}")
    assert proc.returncode == 1, err[-4000:]
    dump = out / "stall" / "1"
    assert f"stacks of the driver and every actor in {dump}" in err
    assert {p.name for p in dump.iterdir()} >= {"driver.txt", "trainer_rank_0.txt", "trainer_rank_1.txt",
                                                   "rollout_engine_0.txt"}
    hung = (dump / "trainer_rank_1.txt").read_text()
    assert "_hang" in hung and "time.sleep(3600)" in hung  # the culprit, found by its stack
    waiting = (dump / "trainer_rank_0.txt").read_text()
    assert "forward_backward" in waiting  # its peer: blocked inside the step's collectives
    assert "wait_all" in (dump / "driver.txt").read_text()
    log = (out / "run.log").read_text()
    assert "a side thread of trainer rank 1 died" in log  # a worker-level exception, surfaced in the run's log
    assert "run failed: stalled" in log


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes on this machine (1 CPU each) and a tracker of which node each actor process runs on."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 200 << 20,
                                                             "include_dashboard": False})
    cluster.add_node(num_cpus=1, object_store_memory=200 << 20)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def _raylet_pids(cluster) -> list[int]:
    return [node.all_processes["raylet"][0].process.pid for node in cluster.list_all_nodes()]


def _watch_placement(cluster, stop: threading.Event, found: dict) -> None:
    """Record {actor pid: node index} for DeepSpeedWorker processes, looking under each node's raylet."""
    import psutil

    raylets = _raylet_pids(cluster)
    while not stop.is_set():
        for index, pid in enumerate(raylets):
            try:
                for child in psutil.Process(pid).children(recursive=True):
                    if "DeepSpeedWorker" in " ".join(child.cmdline()):
                        found[child.pid] = index
            except psutil.Error:
                pass
        stop.wait(0.5)


def test_two_nodes_learn_as_one(two_nodes, tmp_path):
    args = ("algorithm.steps=3", "hardware.placement_strategy=SPREAD")
    found: dict[int, int] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_placement, args=(two_nodes, stop, found), daemon=True)
    watcher.start()
    start = time.monotonic()
    proc = rlspec_run(tmp_path / "two", *args, f"hardware.ray_address={two_nodes.address}")
    _, err = proc.communicate(timeout=500)
    two_s = time.monotonic() - start
    stop.set()
    watcher.join()
    assert proc.returncode == 0, err[-4000:]
    # Both nodes host a trainer rank. One CI run under load saw three processes with the worker's title over the
    # run, two on one node, and the run itself passed; what the third was is not known. Count nodes, not processes.
    assert sorted(set(found.values())) == [0, 1], f"trainer ranks should be on both nodes, found {found}"

    start = time.monotonic()
    proc = rlspec_run(tmp_path / "one", *args)  # a local one-node cluster
    _, err = proc.communicate(timeout=500)
    one_s = time.monotonic() - start
    assert proc.returncode == 0, err[-4000:]
    two = read_metrics(tmp_path / "two" / "metrics.jsonl")
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    print(f"\ntwo nodes {two_s:.0f} s, one node {one_s:.0f} s (incl. start-up); per step (loss, grad_norm, reward):\n"
          f"  two: {[(r['loss'], r['grad_norm'], r['reward/mean']) for r in two]}\n"
          f"  one: {[(r['loss'], r['grad_norm'], r['reward/mean']) for r in one]}")
    assert [r["step"] for r in two] == [0, 1, 2]
    assert any(r["grad_norm"] > 0 for r in one)  # something was learnt (tiny.yaml's batch: 64 sequences)
    for a, b in zip(two, one):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=1e-7)
        assert a["sync/bytes"] == b["sync/bytes"] > 0


def test_more_ranks_than_the_cluster_holds_is_bad_input(tmp_path):
    """4.5 CPUs of bundles on a 2-CPU local cluster: exit 2 naming the key before a cluster is started, not after
    the placement timeout."""
    if (os.cpu_count() or 2) > 2:
        pytest.skip("the local cluster has more than 2 CPUs here")
    out = tmp_path / "big"
    proc = rlspec_run(out, "hardware.num_trainer_ranks=8", "algorithm.micro_batch_size=8")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    assert "hardware.num_trainer_ranks: the plan's ranks and engines need 4.5 CPUs" in err
    # No traceback through rlspec's code. Not "no Traceback at all": Ray's log-printing thread in the driver can die
    # with one of its own when the cluster it reads from shuts down under it (seen once in CI: a gRPC "connection
    # refused" after the error above had been printed).
    assert not re.search(r'File "[^"]*[/\\]rlspec[/\\]', err), err[-3000:]
    assert not out.exists()


# Both slow: the rank group's SIGTERM path (shared by both trainers) runs in CI with a resume on fewer ranks in
# tests/backends/test_logical_faults.py; SIGINT takes the same path as SIGTERM.
@pytest.mark.slow
@pytest.mark.parametrize("signum", [15, 2])
def test_stop_signal_to_the_whole_tree_checkpoints_and_resume_finishes(tmp_path, signum):
    from tests.backends.ranks import preempt_whole_tree

    preempt_whole_tree("deepspeed", tmp_path / "preempted", signum)
