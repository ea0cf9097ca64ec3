"""Async agents on the gateway's one agent event loop: hundreds at once without a thread each, the next agent
starting as soon as one ends (whatever its group), a slow tool holding nothing but its own agent, and a timed-out
async agent cancelled and counted."""

from __future__ import annotations

import sys
import threading
import time

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
    # (all 8 at once: the step takes the timeout, which leaves their first call time on a busy machine)
    gateway, task = gateway_for(engine, monkeypatch, AGENT + "hangs_async", "rollout.agent.timeout_s=1.5",
                                "rollout.agent.max_failure_rate=1.0")
    try:
        with pytest.raises(RunError, match=r"no group kept two valid agent trajectories \(\{'error': 0, 'timeout': 8"):
            gateway.rollout(task.sample(0, 2), 0)
    finally:
        gateway.close()
    assert agents.STATE["cancelled"] == 8


def test_the_multiturn_token_agent_runs_a_step_through_the_gateway_with_ids_past_the_tokenizer(monkeypatch):
    """`examples/agents/multiturn_tokens.py` (each turn re-sent as the previous prompt + sampled ids + a tool result)
    for one step, on a preset whose model embeds more ids than its byte tokenizer has (as the 0.5B shape: 152k
    against 260): the ids it sampled come back in the next turn's prompt and are taken (they were refused with a
    400), every turn after the first reuses the kept prefix, and the trajectories assemble."""
    from rlspec.agent.gateway import AgentGateway
    from rlspec.models.presets import PRESETS
    from rlspec.run import build_plan
    from rlspec.serve.process import build_engine
    from rlspec.user_code import import_function
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)
    monkeypatch.setitem(PRESETS, "tiny_qwen2", {**PRESETS["tiny_qwen2"], "vocab_size": 1024})
    agent = "examples/agents/multiturn_tokens.py"
    module = sys.modules[import_function(f"{agent}:solve", "test").__module__]
    monkeypatch.setattr(module, "TOKENS", (4, 10))  # small turns: CI time
    monkeypatch.setattr(module, "TOOL_TOKENS", (20, 30))
    plan, task = build_plan("examples/agent_copy_two_turn.yaml", [
        f"rollout.agent.function={agent}:solve", "rollout.prompts_per_step=1", "algorithm.group_size=4",
        "algorithm.micro_batch_size=4", "rollout.max_new_tokens=10", "rollout.max_prompt_tokens=256",
        "rollout.agent.max_turns=5", "hardware.num_threads=1"])
    engine = build_engine(plan)
    assert engine.model.config.vocab_size == 1024 and len(engine.tokenizer) < 300
    gateway = AgentGateway(plan, engine)
    try:
        out = gateway.rollout(task.sample(0, 1), 0)
        prefix = gateway.host.thread.pool.prefills.prefix.stats
    finally:
        gateway.close()
    assert out.metrics["agent/failed"] == 0 and out.group_sizes == [4], out.metrics
    assert 3 <= out.metrics["agent/turns_mean"] <= 5
    assert any(t >= len(engine.tokenizer) for ids in out.rollout.completion_ids for t in ids)
    # turns after the first extended the previous one's kept K/V (a first turn of a block's length or less is not
    # kept): only the tool result's tokens prefilled
    turns = round(out.metrics["agent/turns_mean"] * 4)
    assert turns - 8 <= prefix["hits"] <= turns - 4 and prefix["new_tokens"] <= 30 * prefix["hits"], prefix
    for ids, mask in zip(out.rollout.completion_ids, out.rollout.completion_mask):
        assert len(ids) == len(mask) and sum(mask) >= 3 * 4


def test_an_in_process_call_cancelled_while_it_waits_on_the_engine_frees_its_rows(engine, monkeypatch):  # noqa: F811
    """An agent on the agent loop reaches the gateway in process (no socket, so no disconnect to see): a call it
    cancels (or a timeout cancels) while its rows decode takes them out of the decode batch then, not at their end."""
    agents.reset()
    gateway, task = gateway_for(engine, monkeypatch, AGENT + "cancels_its_completion_once_all_rows_decode",
                                "rollout.max_new_tokens=300", "rollout.agent.concurrency=8",
                                "rollout.agent.max_failure_rate=1.0")
    scheduler = agents.STATE["scheduler"] = gateway.host.thread
    agents.STATE["rows"] = 8
    try:
        with pytest.raises(RunError, match=r"'invalid': 8"):  # answered, but no call of theirs was recorded
            gateway.rollout(task.sample(0, 2), 0)
        for _ in range(100):  # the engine thread drops them at its next step
            if not scheduler.pool.live:
                break
            time.sleep(0.01)
    finally:
        gateway.close()
    # gone within a second, where 300 tokens take longer; cancelled, but for any that sampled the end token first
    assert not scheduler.pool.live and scheduler.stats["rows_cancelled"] >= 4, scheduler.stats


def test_in_process_calls_answer_as_the_app_does_over_its_socket(engine, monkeypatch):  # noqa: F811
    """An agent of this process reaches the gateway's routes without the app's HTTP layers
    (`AgentGateway.call_in_process`): the same status codes and bodies as the app over its socket, for a refusal
    of the gateway, of the route, of the request's model (the app answers those itself) and an unknown trajectory;
    a completion the same shape both ways; and the ids it returns are the agent's own copies."""
    from rlspec.agent.client import serve_in_process

    agents.reset()
    gateway, task = gateway_for(engine, monkeypatch, AGENT + "asks_in_process_and_over_the_socket",
                                "rollout.agent.max_turns=4")
    calls = []

    async def counted(method, path, body):
        answer = await gateway.call_in_process(method, path, body)
        calls.append(answer is not None)
        return answer

    port = int(gateway.url.rsplit(":", 1)[1])
    serve_in_process("127.0.0.1", port, gateway.app, counted)
    try:
        out = gateway.rollout(task.sample(0, 2), 0)
    finally:
        gateway.close()
    assert out.metrics["agent/failed"] == 0, out.metrics
    assert len(agents.STATE["pairs"]) == 4 * 8
    for here, there in agents.STATE["pairs"]:
        assert here == there and here[0] in (400, 404), (here, there)
    # each agent: 3 refusals and its completion answered in process; the model's refusal left to the app
    assert calls.count(True) == 4 * 8 and calls.count(False) == 8, calls
    for in_process, over_socket in agents.STATE["choices"]:
        assert in_process.keys() == over_socket.keys() and len(in_process["token_ids"]) >= 2
    assert not any(-7 in ids for ids in out.rollout.completion_ids)


def test_an_in_process_completion_past_its_timeout_raises_the_networks_timeout_and_frees_its_rows(
        engine, monkeypatch):  # noqa: F811
    agents.reset()
    gateway, task = gateway_for(engine, monkeypatch, AGENT + "times_out_its_completion", "rollout.max_new_tokens=300",
                                "rollout.agent.max_failure_rate=1.0")
    scheduler = gateway.host.thread
    try:
        try:  # (a row that samples the end token within the timeout is answered, and its trajectory kept)
            gateway.rollout(task.sample(0, 2), 0)
        except RunError as err:
            assert "'invalid': " in str(err), err  # answered, but no call of theirs was recorded
        for _ in range(100):
            if not scheduler.pool.live:
                break
            time.sleep(0.01)
    finally:
        gateway.close()
    assert agents.STATE.get("timeouts", 0) >= 4, agents.STATE
    assert not scheduler.pool.live and scheduler.stats["rows_cancelled"] >= 4, scheduler.stats
