"""`collate` and `engine_logprobs_tensor` (built from flat tensors and masks) against a plain loop over the rows."""

from __future__ import annotations

import random

import pytest
import torch

from rlspec.rollout.base import Rollout, collate, engine_logprobs_tensor


def _by_row(rollout: Rollout, pad_id: int) -> tuple[torch.Tensor, ...]:
    n = len(rollout.prompt_ids)
    length = max(len(p) + len(c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids))
    ids, attention, loss, logps = (torch.full((n, length), pad_id), torch.zeros(n, length, dtype=torch.long),
                                   torch.zeros(n, length), torch.zeros(n, length))
    for i, (p, c) in enumerate(zip(rollout.prompt_ids, rollout.completion_ids)):
        for j, token in enumerate(p + c):
            ids[i, j], attention[i, j] = token, 1
        for j in range(len(c)):
            loss[i, len(p) + j] = 1.0 if rollout.completion_mask is None else rollout.completion_mask[i][j]
        for j, value in enumerate(rollout.completion_logprobs[i]):
            logps[i, len(p) + j] = value
    return ids, attention, loss, logps


@pytest.mark.parametrize("masked", [False, True])
def test_flat_collation_equals_a_loop_over_rows(masked):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))] for _ in range(23)]
    completions = [[rng.randrange(1, 50) for _ in range(rng.randrange(0, 12))] for _ in prompts]
    rollout = Rollout(prompt_ids=prompts, completion_ids=completions,
                      completion_logprobs=[[-rng.random() for _ in c] for c in completions], texts=[""] * len(prompts),
                      completion_mask=[[float(rng.random() < 0.7) for _ in c] for c in completions] if masked else None)
    batch = collate(rollout, torch.arange(23.0), torch.ones(23), pad_id=0)
    ids, attention, loss, logps = _by_row(rollout, pad_id=0)
    assert torch.equal(batch.input_ids, ids) and torch.equal(batch.attention_mask, attention)
    assert torch.equal(batch.loss_mask, loss)
    assert torch.equal(engine_logprobs_tensor(rollout, batch), logps)
    assert torch.equal(batch.advantages, torch.arange(23.0))
