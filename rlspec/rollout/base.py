"""What a rollout engine returns, the engine protocol, and the collation into a `TrainBatch`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch
from torch import Tensor

from ..core.batch import TrainBatch


@dataclass
class Rollout:
    """`n` sampled completions for each prompt, laid out group after group."""

    prompt_ids: list[list[int]]
    """Prompt token ids per sequence (repeated for each completion of a prompt)."""
    completion_ids: list[list[int]]
    """Sampled token ids, up to and including the end-of-sequence token if one was sampled."""
    completion_logprobs: list[list[float]]
    """The engine's own log-prob of each sampled token, at the sampling temperature."""
    texts: list[str]
    """Decoded completions (special tokens dropped)."""
    completion_mask: list[list[float]] | None = None
    """Per completion token, 1 if the model sampled it (gets loss) and 0 for context between an agent's turns;
    None: every completion token is sampled."""
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    """Per completion token, the (id, log-prob) of the most likely tokens, best first, when a request asked for
    them (`rlspec.rollout.sampling.SampleOptions.top_logprobs`)."""
    weight_version: int | None = None
    """The weight version (trainer steps) that a rollout server reports every one of these samples was drawn with
    (the oldest, for parts from several servers); None from an engine that reports none."""


class RolloutEngine(Protocol):
    """Samples completions; receives weights through a `sync` transport."""

    def generate(self, prompts: list[str], n: int, seed: int) -> Rollout:
        """`n` completions per prompt, reproducible for a given seed."""

    def logprobs(self, batch: TrainBatch) -> Tensor:
        """[N, L] log-probs the engine assigns to `batch` (the sync check compares these with the trainer's)."""

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy weights in by name."""

    def receive(self, fn, payload):
        """Run a sync transport's engine half, `fn(engine, payload)`, where the engine's weights live; return its
        result (a transport's timings; a list of them for several engines)."""

    def named_weights(self) -> Iterable[tuple[str, Tensor]]:
        """The engine's current weights (for verifying a sync)."""


def collate(rollout: Rollout, advantages: Tensor, rewards: Tensor, pad_id: int) -> TrainBatch:
    """Right-padded [N, L] tensors of prompt + completion with a loss mask on the sampled completion tokens."""
    sequences = [p + c for p, c in zip(rollout.prompt_ids, rollout.completion_ids)]
    length = max(len(s) for s in sequences)
    n = len(sequences)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    loss_mask = torch.zeros((n, length), dtype=torch.float32)
    for i, (prompt, completion) in enumerate(zip(rollout.prompt_ids, rollout.completion_ids)):
        total = len(prompt) + len(completion)
        input_ids[i, :total] = torch.tensor(prompt + completion, dtype=torch.long)
        attention_mask[i, :total] = 1
        if rollout.completion_mask is None:
            loss_mask[i, len(prompt):total] = 1.0
        else:
            loss_mask[i, len(prompt):total] = torch.tensor(rollout.completion_mask[i], dtype=torch.float32)
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                      advantages=advantages.float(), rewards=rewards.float())


def engine_logprobs_tensor(rollout: Rollout, like: TrainBatch) -> Tensor:
    """The engine's sampled-token log-probs laid out like `like` (zero outside completions)."""
    out = torch.zeros(like.input_ids.shape, dtype=torch.float32)
    for i, (prompt, logps) in enumerate(zip(rollout.prompt_ids, rollout.completion_logprobs)):
        out[i, len(prompt):len(prompt) + len(logps)] = torch.tensor(logps, dtype=torch.float32)
    return out
