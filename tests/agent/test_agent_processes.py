"""Agents in processes of their own (`rollout.agent.processes`): the same trajectories as in the run's process, token
for token and log-prob for log-prob; failures counted as there; an agent process that dies fails the run naming it.

Each gateway here starts two agent processes (spawned: each imports torch and loads the tokenizer, ~2-3 s)."""

from __future__ import annotations

import os

import pytest

from rlspec.errors import RunError
from rlspec.spec import SpecError
from tests.agent.test_gateway import PROMPTS, SMALL, engine, gateway_for  # noqa: F401 - the module's engine fixture

FIELDS = ("prompt_ids", "completion_ids", "completion_logprobs", "completion_mask", "texts")


def _steps(engine, monkeypatch, *overrides, steps: int = 2):
    gateway, _ = gateway_for(engine, monkeypatch, *overrides)
    try:
        return [gateway.rollout(PROMPTS, step) for step in range(steps)], gateway
    finally:
        gateway.close()


@pytest.mark.parametrize("agent", ["examples/agents/copy_two_turn.py:solve", "examples/agents/chat_tool.py:solve"])
def test_agents_in_two_processes_sample_what_they_sample_in_the_runs_process(engine, monkeypatch, agent):  # noqa: F811
    """The completions agent (`complete`: the process's socket) and the openai chat agent (`http_client`: in process,
    its second turn rendered with the first turn's sampled ids, which live in the agent process's records)."""
    if "chat" in agent:
        pytest.importorskip("openai")
    here, _ = _steps(engine, monkeypatch, f"rollout.agent.function={agent}")
    there, gateway = _steps(engine, monkeypatch, f"rollout.agent.function={agent}", "rollout.agent.processes=2")
    assert gateway.front is None and len(gateway.processes.procs) == 2
    assert all(not proc.is_alive() for proc in gateway.processes.procs)  # closed with the gateway
    for a, b in zip(here, there):
        assert a.metrics == b.metrics and a.metrics["agent/failed"] == 0 and a.metrics["agent/turns_mean"] == 2.0
        assert a.group_sizes == b.group_sizes and [p.text for p in a.prompts] == [p.text for p in b.prompts]
        for name in FIELDS:
            assert getattr(a.rollout, name) == getattr(b.rollout, name), name
    assert here[0].rollout.completion_ids != here[1].rollout.completion_ids  # each step its own seeds


def test_failed_agents_in_processes_are_counted_and_dropped_as_in_the_runs_process(engine, monkeypatch):  # noqa: F811
    overrides = ("rollout.agent.function=tests.agent.agents:raises_on_b", "rollout.agent.max_failure_rate=0.5")
    here, _ = _steps(engine, monkeypatch, *overrides, steps=1)
    there, _ = _steps(engine, monkeypatch, *overrides, "rollout.agent.processes=2", steps=1)
    assert there[0].metrics == here[0].metrics and there[0].metrics["agent/errors"] == 4
    assert there[0].group_sizes == [4] and there[0].rollout.completion_ids == here[0].rollout.completion_ids


def test_an_agent_process_that_dies_fails_the_run_naming_it(engine, monkeypatch):  # noqa: F811
    gateway, _ = gateway_for(engine, monkeypatch, "rollout.agent.function=tests.agent.agents:exits_its_process_on_b",
                             "rollout.agent.processes=2", "rollout.agent.max_failure_rate=1.0")
    try:
        with pytest.raises(RunError, match=r"agent process [01] \(pid \d+\) exited with code 3 while its agents ran"):
            gateway.rollout(PROMPTS, 0)
    finally:
        gateway.close()
    assert all(not proc.is_alive() for proc in gateway.processes.procs)
    # the engine's rows of the dead process's agents left the batch: the next gateway samples as before
    fresh, _ = _steps(engine, monkeypatch, steps=1)
    assert fresh[0].metrics["agent/failed"] == 0


def test_agent_processes_is_checked_and_a_bad_agent_is_named_before_any_process_starts(engine, monkeypatch):  # noqa: F811
    import multiprocessing

    with pytest.raises(SpecError, match="rollout.agent.processes"):
        gateway_for(engine, monkeypatch, "rollout.agent.processes=-1")
    with pytest.raises(SpecError, match="rollout.agent.function"):
        gateway_for(engine, monkeypatch, "rollout.agent.function=tests.agent.agents:no_such_agent",
                    "rollout.agent.processes=2")
    assert not multiprocessing.active_children()


def test_a_sigterm_to_the_runs_process_group_checkpoints_exits_143_and_leaves_no_process(tmp_path):
    """A preemption's SIGTERM to every process of the run (`rlspec run` and its agent processes): the run's process
    checkpoints its last step and exits 143 as alone (`tests/test_faults.py`), whatever the agent processes did
    first, and none of them is left."""
    import signal
    import subprocess
    import time

    from rlspec.runtime.metrics import read_metrics
    from tests.conftest import REPO, interrupt_after_rows, rlspec_cmd

    out = tmp_path / "o"
    proc = subprocess.Popen(rlspec_cmd("run", "examples/agent_copy_two_turn.yaml", *SMALL, "algorithm.steps=40",
                                       "rollout.agent.processes=2", "checkpoint.every_n_steps=0", "--out", str(out),
                                       "--no-progress"),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    err, took = interrupt_after_rows(proc, out / "metrics.jsonl", 2, lambda: os.killpg(proc.pid, signal.SIGTERM))
    print(f"\nSIGTERM to the group: exit {proc.returncode} {took:.2f} s after the signal")
    assert proc.returncode == 143, err[-3000:]
    last = read_metrics(out / "metrics.jsonl")[-1]["step"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{last:06d}"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # any process of the group left?
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("a process of the run's group outlived it")
