"""Sampling pieces shared by the plain loop (`hf`), the CUDA-graph sampler (`static`) and the env rollouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SampleOptions:
    """What a single request may add to the spec's sampling settings (a rollout server's OpenAI requests).
    Either one makes the `hf` engine take its plain loop (the CUDA-graph sampler does neither)."""

    greedy: bool = False
    """Take the argmax instead of sampling; log-probs are then the model's plain log_softmax (temperature 1)."""
    top_logprobs: int = 0
    """Also return, per step, the ids and log-probs of the this-many most likely tokens (same distribution as
    the chosen token's log-prob)."""

    @property
    def plain_loop_only(self) -> bool:
        return self.greedy or self.top_logprobs > 0


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Zero the tail outside the smallest set of tokens whose mass reaches `top_p` (rows need not renormalise)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keeps at least the most likely token
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def next_token(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator,
               greedy: bool = False) -> tuple[Tensor, Tensor]:
    """The chosen token of each row [B] and the log-probs [B, V] it was chosen from: log_softmax(logits / T)
    sampled with top-p, or, greedy, the argmax under the plain log_softmax(logits)."""
    if greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp.argmax(dim=-1), logp
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(top_p_filter(logp.exp(), top_p), 1, generator=generator).squeeze(-1), logp
