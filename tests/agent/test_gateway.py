"""The agent gateway against its real HTTP server on 127.0.0.1, with the tiny model's in-process engine.

One engine for the module; each test starts a gateway (a uvicorn thread, ~0.1 s) for its agent. Steps use
2 prompts x group 4 (8 trajectories, each one or two completion calls of at most 4 tokens).
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

from rlspec.errors import RunError
from rlspec.core.policy import batch_logprobs
from rlspec.rollout.base import collate, engine_logprobs_tensor
from rlspec.run import build_plan
from rlspec.serve.process import build_engine
from rlspec.spec import SpecError
from rlspec.tasks import Prompt
from tests.conftest import REPO

SPEC = "examples/agent_copy_two_turn.yaml"
SMALL = ["rollout.prompts_per_step=2", "algorithm.group_size=4", "algorithm.micro_batch_size=8"]


@pytest.fixture(scope="module")
def engine():
    plan, _ = build_plan(str(REPO / SPEC), SMALL)
    return build_engine(plan)


def gateway_for(engine, monkeypatch, *overrides):
    from rlspec.agent.gateway import AgentGateway

    monkeypatch.chdir(REPO)
    plan, task = build_plan(SPEC, [*SMALL, *overrides])
    return AgentGateway(plan, engine), task


PROMPTS = [Prompt("a=", {"letter": "a"}), Prompt("b=", {"letter": "b"})]


def run_step(engine, monkeypatch, *overrides, prompts=PROMPTS):
    gateway, task = gateway_for(engine, monkeypatch, *overrides)
    try:
        return gateway.rollout(prompts, 0), task
    finally:
        gateway.close()


def test_two_turn_agent_trains_only_model_tokens_on_exactly_what_the_engine_saw(engine, monkeypatch):
    out, task = run_step(engine, monkeypatch)
    rollout = out.rollout
    assert out.group_sizes == [4, 4] and out.metrics["agent/failed"] == 0 and out.metrics["agent/turns_mean"] == 2.0
    batch = collate(rollout, torch.zeros(8), torch.zeros(8), engine.tokenizer.pad_token_id)
    for i, (prompt, ids, mask) in enumerate(zip(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask)):
        assert prompt == engine.tokenizer(out.prompts[i].text, add_special_tokens=False).input_ids
        # context: the tool message, after any bytes of the first completion that came back re-encoded
        context = engine.tokenizer.decode([t for t, m in zip(ids, mask) if m == 0])
        assert re.search(r"\|\d>$", context), context
        assert 1 <= sum(mask) <= 8
    # Dr. GRPO's constant is the trajectory's budget (2 turns x 4 tokens): more than one turn's tokens, never exceeded
    trained = [sum(mask) for mask in rollout.completion_mask]
    budget = build_plan(str(REPO / SPEC), SMALL, full=False)[0].batch.max_trained_tokens
    assert 4 < max(trained) <= budget == 8
    # The trainer's log-probs of the assembled sequences equal the engine's at every model token: the
    # context is token for token what the engine was given.
    trainer = batch_logprobs(engine.model, batch, engine.spec.temperature, 8, "cpu")
    sampled = batch.loss_mask > 0
    torch.testing.assert_close(trainer[sampled], engine_logprobs_tensor(rollout, batch)[sampled], atol=1e-5, rtol=0)
    assert (engine_logprobs_tensor(rollout, batch)[~sampled] == 0).all()
    assert all(isinstance(t, str) for t in rollout.texts)


def test_an_agent_that_raises_is_counted_and_dropped_never_scored(engine, monkeypatch):
    # the 'b' group fails entirely; its agents made a call first, which must not reach the batch
    out, _ = run_step(engine, monkeypatch, "rollout.agent.function=tests.agent.agents:raises_on_b",
                      "rollout.agent.max_failure_rate=0.5")
    assert out.metrics["agent/errors"] == 4 and out.metrics["agent/dropped"] == 4
    assert out.group_sizes == [4] and {p.text for p in out.prompts} == {"a="} and len(out.rollout.texts) == 4
    # one failure per group: the other three still form a group, normalised among themselves
    out, _ = run_step(engine, monkeypatch, "rollout.agent.function=tests.agent.agents:raises_in_first_of_group")
    assert out.metrics["agent/errors"] == 2 and out.group_sizes == [3, 3]
    # groups of two: each survivor is alone, so nothing is left to train on
    with pytest.raises(RunError, match="no group kept two valid agent trajectories"):
        run_step(engine, monkeypatch, "rollout.agent.function=tests.agent.agents:raises_in_first_of_group",
                 "algorithm.group_size=2", "algorithm.micro_batch_size=4", "rollout.agent.max_failure_rate=0.5")
    with pytest.raises(RunError, match=r"4 of 8 agent trajectories failed .*max_failure_rate=0.25; first: agent raised RuntimeError: tool crashed on b"):
        run_step(engine, monkeypatch, "rollout.agent.function=tests.agent.agents:raises_on_b")


@pytest.mark.parametrize("agent, kind, reason", [
    ("returns_number", "invalid", "returned int, not a str"),
    ("never_calls", "invalid", "without asking the model"),
    ("rewrites_history", "invalid", "does not start with call 1's prompt"),
    ("too_many_turns", "invalid", "max_turns=2"),
])
def test_invalid_trajectories_fail_the_step_with_their_reason(engine, monkeypatch, agent, kind, reason):
    with pytest.raises(RunError, match=reason) as err:
        run_step(engine, monkeypatch, f"rollout.agent.function=tests.agent.agents:{agent}")
    assert "8 of 8" in str(err.value) and f"'{kind}': 8" in str(err.value)


def test_a_function_agent_past_its_timeout_is_abandoned_and_its_requests_refused(engine, monkeypatch):
    gateway, task = gateway_for(engine, monkeypatch, "rollout.agent.function=tests.agent.agents:sleeps",
                                "rollout.agent.timeout_s=0.2", "rollout.agent.max_failure_rate=1.0")
    try:
        with pytest.raises(RunError, match=r"no group kept two valid agent trajectories \(\{'error': 0, 'timeout': 8"):
            gateway.rollout(task.sample(0, 2), 0)
    finally:
        gateway.close()


COMMAND_STEP = ["rollout.agent.function=null", "rollout.prompts_per_step=1", "algorithm.group_size=2",
                "algorithm.micro_batch_size=2"]


def test_command_agent(engine, monkeypatch, tmp_path):
    out, _ = run_step(engine, monkeypatch, f"rollout.agent.command=[{sys.executable},examples/agents/copy_two_turn.py]",
                      *COMMAND_STEP, prompts=PROMPTS[:1])
    assert out.metrics["agent/failed"] == 0 and out.group_sizes == [2] and out.metrics["agent/turns_mean"] == 2.0
    garbage = tmp_path / "garbage.py"
    garbage.write_text("print('not json')\n")
    stuck = tmp_path / "stuck.py"
    stuck.write_text("import time\ntime.sleep(60)\n")
    crash = tmp_path / "crash.py"
    crash.write_text("import sys\nsys.exit('agent broke')\n")
    for script, match in ((garbage, r"'invalid': 2.*not \{\"answer\": \.\.\.\} JSON"),
                          (stuck, r"'timeout': 2.*still running after 1 s"),
                          (crash, r"'error': 2.*exited with code 1")):
        with pytest.raises(RunError, match=match) as err:
            run_step(engine, monkeypatch, f"rollout.agent.command=[{sys.executable},{script}]", "rollout.agent.timeout_s=1",
                     *COMMAND_STEP, prompts=PROMPTS[:1])
        if script is crash:
            assert "agent broke" in str(err.value)


def test_bad_agent_specs_are_refused_before_the_run(monkeypatch):
    monkeypatch.chdir(REPO)
    cases = [
        (["rollout.agent.function=tests.agent.agents:nope"], "rollout.agent.function: tests.agent.agents has no function 'nope'"),
        (["rollout.agent.function=missing/agent.py:solve"], "missing/agent.py does not exist"),
        (["rollout.agent.function=solve"], "is not of the form module:function"),
        (["rollout.agent.command=[no-such-program-xyz]", "rollout.agent.function=null"], "not an executable"),
        (["rollout.agent.command=[python]"], "both rollout.agent.function and rollout.agent.command are set"),
        (["rollout.agent.max_failure_rate=1.5"], "rollout.agent.max_failure_rate"),
    ]
    for overrides, message in cases:
        with pytest.raises(SpecError, match=message.replace("(", r"\(")):
            build_plan(SPEC, overrides)
    with pytest.raises(SpecError, match="rollout.agent: .* trainer ranks"):
        build_plan(SPEC, ["hardware.num_trainer_ranks=2", "rollout.prompts_per_step=8"], backend="deepspeed")


CHAT_AGENT = "rollout.agent.function=examples/agents/chat_tool.py:solve"


def test_chat_turns_extend_the_previous_turn_with_the_ids_the_model_sampled(engine, monkeypatch):
    pytest.importorskip("openai")
    out, _ = run_step(engine, monkeypatch, CHAT_AGENT)
    assert out.metrics["agent/failed"] == 0 and out.metrics["agent/turns_mean"] == 2.0
    rollout, eos, tok = out.rollout, engine.tokenizer.eos_token_id, engine.tokenizer
    batch = collate(rollout, torch.zeros(8), torch.zeros(8), tok.pad_token_id)
    not_text = 0
    for ids, mask in zip(rollout.completion_ids, rollout.completion_mask):
        first = ids[:mask.index(0.0)]  # turn 1 as sampled (an end token it sampled: the template's own end)
        assert len(first) == 4 or first[-1] == eos
        assert "<|im_start|>tool\n" in tok.decode([t for t, m in zip(ids, mask) if m == 0])
        assert 1 <= sum(mask) - len(first) <= 4  # turn 2
        not_text += tok(tok.decode(first, skip_special_tokens=True), add_special_tokens=False).input_ids != \
            [t for t in first if t != eos]
    assert not_text > 0  # some turn's bytes are not text that would re-encode to them: only splicing keeps them
    trainer = batch_logprobs(engine.model, batch, engine.spec.temperature, 8, "cpu")
    sampled = batch.loss_mask > 0
    torch.testing.assert_close(trainer[sampled], engine_logprobs_tensor(rollout, batch)[sampled], atol=1e-5, rtol=0)


def test_a_chat_template_that_renders_earlier_turns_differently_makes_the_trajectory_invalid(engine, monkeypatch):
    pytest.importorskip("openai")
    from rlspec.models.base import BYTE_CHAT_TEMPLATE

    generation = "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
    thinking = BYTE_CHAT_TEMPLATE.replace(generation, generation.replace("\n{%", "\n<think></think>{%"))
    assert thinking != BYTE_CHAT_TEMPLATE
    monkeypatch.setattr(engine.tokenizer, "chat_template", thinking)
    from examples.agents.chat_tool import TOOLS

    first_prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "a="}], tools=TOOLS,
                                                        add_generation_prompt=True, tokenize=True)
    first_prompt = getattr(first_prompt, "input_ids", first_prompt)
    at = len(first_prompt) - len("<think></think>")
    with pytest.raises(RunError, match=rf"'invalid': 8.*first difference at token {at} of {len(first_prompt)}"):
        run_step(engine, monkeypatch, CHAT_AGENT)
    dropping = BYTE_CHAT_TEMPLATE.replace("{%- for m in messages -%}", "{%- for m in messages if m.role != 'assistant' -%}")
    monkeypatch.setattr(engine.tokenizer, "chat_template", dropping)
    with pytest.raises(RunError, match=r"'invalid': 8.*rendered assistant message 1 0 times"):
        run_step(engine, monkeypatch, CHAT_AGENT)
