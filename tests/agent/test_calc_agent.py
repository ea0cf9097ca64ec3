"""The GSM8K calculator agent example through the real gateway, against a scripted engine (the tiny model never
writes a tool call): the tool result is context, the model's text on both sides of it gets loss.

The scripted engine is not an `hf` engine, so this also covers the gateway's wrapper for other engines."""

from __future__ import annotations

import importlib.util

import torch

from rlspec.models.base import byte_tokenizer
from rlspec.rollout.base import Rollout
from rlspec.run import build_plan
from rlspec.tasks import Prompt
from tests.conftest import REPO


class ScriptedEngine:
    """Answers with a calculator call first, then with the final answer once the result is in the prompt."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prompts: list[str] = []

    def generate(self, prompts: list[str], n: int, seed: int) -> Rollout:
        (prompt,) = prompts
        self.prompts.append(prompt)
        text = " 3 boxes of 4 is <calc>3*4</calc> so" if prompt.endswith("Answer:") else " in all #### 12"
        ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
        out = self.tokenizer(text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
        return Rollout([ids], [out], [[-0.5] * len(out)], [text])


def test_calculator_agent_trajectory(monkeypatch):
    from rlspec.agent.gateway import AgentGateway

    monkeypatch.chdir(REPO)
    plan, task = build_plan("examples/gsm8k_calc_agent.yaml", ["algorithm.group_size=2", "algorithm.micro_batch_size=2",
                                                              "rollout.prompts_per_step=1"])
    tok = byte_tokenizer()
    engine = ScriptedEngine(tok)
    gateway = AgentGateway(plan, engine)
    try:
        out = gateway.rollout([Prompt("Question: 3 boxes of 4 eggs?\nAnswer:", {"answer": "12"})], 0)
    finally:
        gateway.close()
    assert out.metrics["agent/turns_mean"] == 2.0 and out.group_sizes == [2]
    assert sum(p.endswith("Answer: 3 boxes of 4 is <calc>3*4</calc> = 12\n") for p in engine.prompts) == 2
    answer = out.rollout.texts[0]
    assert answer == " 3 boxes of 4 is <calc>3*4</calc> = 12\n in all #### 12"
    assert task.reward(answer, out.prompts[0]) == 1.0
    ids, mask = out.rollout.completion_ids[0], torch.tensor(out.rollout.completion_mask[0])
    model_text = tok.decode([t for t, m in zip(ids, mask) if m == 1], skip_special_tokens=True)
    context_text = tok.decode([t for t, m in zip(ids, mask) if m == 0])
    # the agent cut " so" after the call; the space it then wrote itself is the space the model sampled at
    # that position, so that token keeps its loss and the context starts after it
    assert model_text == " 3 boxes of 4 is <calc>3*4</calc>  in all #### 12"
    assert context_text == "= 12\n"
    assert ids[-1] == tok.eos_token_id and mask[-1] == 1


def test_calc_agent_example_is_a_command_too():
    spec = importlib.util.spec_from_file_location("gsm8k_calc", REPO / "examples/agents/gsm8k_calc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.calculator("1,000 / 8") == "125" and module.calculator("__import__('os')").startswith("error:")
