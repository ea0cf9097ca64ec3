"""Several-GPU faults on CPU: colocated runs on Ray's logical GPUs (a joined cluster started with `num_gpus=4` and the
`LOGICAL_GPUS_ENV` hook: ranks and engines reserve GPUs exactly as on CUDA, the tensors stay on CPU), through the
real `rlspec run`, each fault injected after two steps:

- SIGTERM to the driver: the last step is checkpointed, exit 143, and the joined cluster (the user's) is left
  running; `--resume` on one rank and one engine continues the run (CI, fsdp);
- a trainer rank SIGKILLed, an engine actor SIGKILLed: exit 1 naming the dead actor;
- a trainer rank out of memory (the `RLSPEC_FAULT_INJECT` hook): exit 1 naming the micro-batch budget and the fix;
- a trainer rank stopped (SIGSTOP) while its peer waits for it in a collective: the stall timeout fires and the
  run exits 1 naming the rank that did not answer.

Every case ends within a minute of the fault with the documented exit code (docs/running.md), no actor process
of the run left on the cluster, and a latest checkpoint that `from_pretrained` loads. Only the SIGTERM case runs
in CI; the others (and deepspeed) are `slow`: the shared watchdog's handling of a dead rank runs in CI in
tests/backends/fsdp/test_fsdp.py. `tests/gpu/faults.sh` injects the same faults on GPUs.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from rlspec.cluster.placement import LOGICAL_GPUS_ENV
from rlspec.runtime.metrics import read_metrics
from tests.backends.ranks import rlspec_run
from tests.conftest import interrupt_after_rows

pytestmark = pytest.mark.distributed
ray = pytest.importorskip("ray")

SMALL = ("rollout.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=1",
         "rollout.max_new_tokens=4", "checkpoint.every_n_steps=1", "checkpoint.keep_last=1")
TITLES = {"fsdp": "FSDPWorker", "deepspeed": "DeepSpeedWorker"}
ENGINE_TITLE = "EngineWorker"
FAULT_TO_EXIT_S = 60


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of one node with 4 logical GPUs, started by the test: the runs join it (`hardware.ray_address`)."""
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 4,
                                                             "object_store_memory": 200 << 20,
                                                             "include_dashboard": False})
    try:
        yield cluster
    finally:
        cluster.shutdown()


def run_actors(cluster, title: str) -> list[int]:
    """Pids of the processes under the cluster's raylet whose command line names `title` (Ray titles an actor's
    process `ray::<class>.<method>`)."""
    import psutil

    raylet = cluster.head_node.all_processes["raylet"][0].process.pid
    pids = []
    for proc in psutil.Process(raylet).children(recursive=True):
        try:
            if title in " ".join(proc.cmdline()):
                pids.append(proc.pid)
        except psutil.Error:
            pass
    return pids


def start(cluster, backend: str, out: Path, *overrides: str, ranks: int = 2, env_extra: dict | None = None):
    return rlspec_run(backend, out, *SMALL, "hardware.rollout=colocated", f"hardware.num_rollout_engines={ranks}",
                      f"hardware.ray_address={cluster.address}", *overrides, ranks=ranks,
                      env={LOGICAL_GPUS_ENV: "1", **(env_extra or {})})


def assert_cleaned_up(cluster, backend: str, out: Path) -> None:
    """No actor of the run left on the cluster, the cluster itself still up, and the latest checkpoint loads."""
    from transformers import AutoModelForCausalLM

    deadline = time.monotonic() + 20
    left = run_actors(cluster, TITLES[backend]) + run_actors(cluster, ENGINE_TITLE)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = run_actors(cluster, TITLES[backend]) + run_actors(cluster, ENGINE_TITLE)
    assert not left, f"actor processes left: {left}"
    assert cluster.head_node.remaining_processes_alive(), "the joined cluster was stopped with the run"
    latest = sorted((out / "checkpoints").iterdir())[-1]
    AutoModelForCausalLM.from_pretrained(latest)


def test_sigterm_leaves_the_joined_cluster_and_resume_on_fewer_ranks_continues(cluster, tmp_path):
    backend, out = "fsdp", tmp_path / "run"
    proc = start(cluster, backend, out, "algorithm.steps=100", "hardware.preempt_grace_s=50")
    err, took = interrupt_after_rows(proc, out / "metrics.jsonl", 2, lambda: proc.send_signal(signal.SIGTERM))
    print(f"\nSIGTERM to a 2-rank colocated {backend} run on logical GPUs: exit {proc.returncode} {took:.1f} s later")
    assert proc.returncode == 143, err[-4000:]
    assert took < FAULT_TO_EXIT_S
    rows = read_metrics(out / "metrics.jsonl")
    last = rows[-1]["step"]
    assert f"SIGTERM: stopped after step {last}" in err and [p.name for p in (out / "checkpoints").iterdir()] == [
        f"step_{last:06d}"]
    assert_cleaned_up(cluster, backend, out)

    proc = start(cluster, backend, out, f"algorithm.steps={last + 3}", "--resume", ranks=1)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(last + 3))
    assert_cleaned_up(cluster, backend, out)


def _kill_one(cluster, title: str, signum: int) -> int:
    pids = run_actors(cluster, title)
    assert len(pids) == 2, pids
    os.kill(max(pids), signum)
    return max(pids)


def test_out_of_memory_in_a_rank_names_the_micro_batch_budget():
    from rlspec.cluster.ray_group import out_of_memory
    from rlspec.core.backend import all_caps
    from rlspec.errors import RunError
    from rlspec.spec import compile_plan, load_spec
    from tests.backends.ranks import TINY

    plan = compile_plan(load_spec(str(TINY), ["algorithm.micro_batch_tokens=4096"], "fsdp"), all_caps())
    failed = RunError("trainer rank 1 failed: OutOfMemoryError",
                      "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory")
    named = out_of_memory(plan, "forward_backward", failed)
    assert str(named).startswith("trainer rank 1 failed: OutOfMemoryError: out of GPU memory in forward_backward at "
                                 "algorithm.micro_batch_tokens=4096 per micro-batch — lower it")
    assert named.worker_traceback == failed.worker_traceback
    assert out_of_memory(plan, "forward_backward", RunError("trainer rank 1 failed: ValueError", "x")) is None


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
@pytest.mark.parametrize("fault", ["kill_rank", "kill_engine", "stop_rank", "oom"])
def test_a_fault_mid_run_ends_it_within_a_minute_naming_the_actor(cluster, tmp_path, backend, fault):
    out = tmp_path / "run"
    oom = ("rank=1,step=2,mode=oom",) if fault == "oom" else ()
    proc = start(cluster, backend, out, "algorithm.steps=200", "hardware.stall_timeout_s=20",
                 env_extra={"RLSPEC_FAULT_INJECT": oom[0]} if oom else None)
    hit = []
    title = ENGINE_TITLE if fault == "kill_engine" else TITLES[backend]
    signum = signal.SIGSTOP if fault == "stop_rank" else signal.SIGKILL

    def inject() -> None:
        if fault != "oom":  # the rank runs out of memory in its third forward_backward by itself
            hit.append(_kill_one(cluster, title, signum))

    try:
        err, took = interrupt_after_rows(proc, out / "metrics.jsonl", 2, inject, timeout_s=120)
    finally:
        for pid in hit:  # a stopped rank the run could not kill (it must have): never leave it behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    line = [ln for ln in err.splitlines() if ln.startswith("rlspec: run failed")][-1:]
    print(f"\n{fault} in a 2-rank colocated {backend} run on logical GPUs: exit {proc.returncode} {took:.1f} s later; "
          f"{line}")
    assert proc.returncode == 1, err[-4000:]
    assert took < FAULT_TO_EXIT_S
    if fault == "kill_rank":
        assert re.search(r"run failed: .*trainer rank \d+ died", err), err[-4000:]  # maybe while checkpointing
    elif fault == "kill_engine":
        assert re.search(r"run failed: .*rollout engine \d+ died", err), err[-4000:]
    elif fault == "oom":
        assert "trainer rank 1 failed: OutOfMemoryError: out of GPU memory in forward_backward at " \
               "algorithm.micro_batch_size=1 per micro-batch — lower it" in err, err[-4000:]
    else:
        assert "stalled: no step completed" in err and "did not answer (stopped, frozen or gone" in err, err[-4000:]
        assert len([ln for ln in err.splitlines() if "did not answer (stopped" in ln]) >= 1
        named = err.split("stalled: no step completed", 1)[1].split("did not answer (stopped", 1)[0]
        assert "trainer rank" in named and "rollout engine" not in named, named
        rank = named.rsplit("trainer rank ", 1)[1].split()[0]  # its dump says the process was seen stopped
        assert "is stopped (state T" in (out / "stall" / "1" / f"trainer_rank_{rank}.txt").read_text()
    assert_cleaned_up(cluster, backend, out)
