"""Trajectory assembly, the loss mask in `collate`, ragged group advantages and the calculator (no server)."""

from __future__ import annotations

import pytest
import torch

from rlspec.agent import Call, ContextMismatch, assemble
from rlspec.agent.calculator import CalculatorError, evaluate, format_number
from rlspec.core.grpo import group_advantages, ragged_group_advantages
from rlspec.rollout.base import Rollout, collate

EOS = 2


def test_single_call_is_prompt_then_completion_all_trained():
    t = assemble([Call([10, 11], [20, 21, EOS], [-0.1, -0.2, -0.3])])
    assert (t.prompt_ids, t.completion_ids, t.completion_mask) == ([10, 11], [20, 21, EOS], [1.0, 1.0, 1.0])
    assert t.completion_logprobs == [-0.1, -0.2, -0.3]


def test_two_turns_tool_text_is_context_and_a_dropped_eos_is_not_in_the_sequence():
    first = Call([10, 11], [20, 21, EOS], [-0.1, -0.2, -0.3])
    # the agent re-sent the decoded text (no end token), then a tool message 30 31
    second = Call([10, 11, 20, 21, 30, 31], [40, 41], [-0.4, -0.5])
    t = assemble([first, second])
    assert t.prompt_ids == [10, 11]
    assert t.completion_ids == [20, 21, 30, 31, 40, 41]
    assert t.completion_mask == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert t.completion_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.4, -0.5]
    assert t.num_model_tokens == 4


def test_a_completion_cut_by_the_agent_keeps_only_the_repeated_prefix():
    first = Call([10], [20, 21, 22, 23], [-1.0, -2.0, -3.0, -4.0])
    second = Call([10, 20, 21, 99], [40], [-5.0])  # kept 20 21, then its own text 99 in place of 22
    t = assemble([first, second])
    assert t.completion_ids == [20, 21, 99, 40]
    assert t.completion_mask == [1.0, 1.0, 0.0, 1.0]
    assert t.completion_logprobs == [-1.0, -2.0, 0.0, -5.0]


def test_a_turn_that_does_not_extend_the_previous_prompt_is_refused():
    with pytest.raises(ContextMismatch, match="call 2's prompt does not start with call 1's prompt"):
        assemble([Call([10, 11], [20], [-1.0]), Call([10, 12, 20], [30], [-1.0])])
    with pytest.raises(ValueError):
        assemble([])


def test_collate_puts_the_completion_mask_on_the_loss_mask():
    rollout = Rollout([[1, 2], [1]], [[3, 4, 5], [6]], [[-1.0, 0.0, -2.0], [-3.0]], ["x", "y"],
                      completion_mask=[[1.0, 0.0, 1.0], [1.0]])
    batch = collate(rollout, torch.zeros(2), torch.zeros(2), pad_id=0)
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    plain = collate(Rollout([[1]], [[3, 4]], [[-1.0, -1.0]], ["x"]), torch.zeros(1), torch.zeros(1), pad_id=0)
    assert plain.loss_mask.tolist() == [[0, 1, 1]]


def test_ragged_advantages_normalise_each_group_alone():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 0.0, 0.0])
    got = ragged_group_advantages(rewards, [3, 4], "group_std", 1e-6)
    torch.testing.assert_close(got[:3], group_advantages(rewards[:3], 3, "group_std", 1e-6))
    torch.testing.assert_close(got[3:], group_advantages(rewards[3:], 4, "group_std", 1e-6))
    with pytest.raises(ValueError):
        ragged_group_advantages(rewards, [3, 3])


def test_calculator_evaluates_arithmetic_and_refuses_everything_else():
    assert evaluate("3*4") == 12
    assert evaluate("(1,000 + 200) / 4") == 300
    assert evaluate("-2**3 % 5") == 2
    assert format_number(evaluate("7/2")) == "3.5" and format_number(12.0) == "12"
    for bad in ("__import__('os')", "x + 1", "9**9**9", "1/0", "[1]", "", "1" * 300, "open('f')", "(1).real"):
        with pytest.raises(CalculatorError):
            evaluate(bad)
