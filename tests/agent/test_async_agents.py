"""Async agents on the gateway's one agent event loop: hundreds at once without a thread each, the next agent
starting as soon as one ends (whatever its group), a slow tool holding nothing but its own agent, and a timed-out
async agent cancelled and counted."""

from __future__ import annotations

import threading

import pytest

from rlspec.errors import RunError
from rlspec.tasks import Prompt
from tests.agent import agents
from tests.agent.test_gateway import engine, gateway_for  # noqa: F401 - the module's engine fixture

AGENT = "rollout.agent.function=tests.agent.agents:"


def test_many_async_agents_run_at_once_without_a_thread_each(engine, monkeypatch):  # noqa: F811
    agents.reset()
    before = threading.active_count()
    gateway, _ = gateway_for(engine, monkeypatch, AGENT + "two_turns_counting_threads", "rollout.prompts_per_step=8",
                             "algorithm.micro_batch_size=32", "rollout.agent.concurrency=32")
    try:
        out = gateway.rollout([Prompt(f"{'abcd'[i % 4]}=", {"letter": "abcd"[i % 4]}) for i in range(8)], 0)
    finally:
        gateway.close()
    assert out.metrics["agent/trajectories"] == 32 and out.metrics["agent/failed"] == 0
    assert out.metrics["agent/turns_mean"] == 2.0 and len(agents.STATE["finished"]) == 32
    # the gateway's server thread and the agent loop's (and a few of other tests' finishing): not one per agent
    assert agents.STATE["threads"] - before < 8, (before, agents.STATE["threads"])


def test_a_slow_tool_holds_only_its_own_agent_and_finished_agents_free_their_slot(engine, monkeypatch):  # noqa: F811
    agents.reset()
    gateway, _ = gateway_for(engine, monkeypatch, AGENT + "slow_tool_in_first_of_group", "rollout.prompts_per_step=1",
                             "algorithm.micro_batch_size=4", "rollout.agent.concurrency=2",
                             "rollout.agent.timeout_s=60")
    try:
        out = gateway.rollout([Prompt("a=", {"letter": "a"})], 0)
    finally:
        gateway.close()
    assert out.metrics["agent/failed"] == 0 and out.group_sizes == [4]
    assert "-g0-" in agents.STATE["finished"][-1]  # the slow one ended last, after the three that started after it


def test_an_async_agent_past_its_timeout_is_cancelled_and_counted(engine, monkeypatch):  # noqa: F811
    agents.reset()
    gateway, task = gateway_for(engine, monkeypatch, AGENT + "hangs_async", "rollout.agent.timeout_s=0.2",
                                "rollout.agent.max_failure_rate=1.0")
    try:
        with pytest.raises(RunError, match=r"no group kept two valid agent trajectories \(\{'error': 0, 'timeout': 8"):
            gateway.rollout(task.sample(0, 2), 0)
    finally:
        gateway.close()
    assert agents.STATE["cancelled"] == 8
