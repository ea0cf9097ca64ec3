"""Sampling pieces shared by the plain loop (`hf`), the CUDA-graph sampler (`static`) and the env rollouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.grpo import logsumexp_in_parts, vocab_splits
from . import sampled_head
from .noise import keyed_exponential


@dataclass(frozen=True)
class SampleOptions:
    """What a single request may add to the spec's sampling settings (a rollout server's OpenAI requests).
    Top log-probs make the `hf` engine's `generate` take its plain loop; the CUDA-graph sampler decodes greedily at
    temperature 0 (`sample_from_hidden`); a rollout server's slot pool (`rlspec.serve.pool`) does both."""

    greedy: bool = False
    """Take the argmax instead of sampling; log-probs are then the model's plain log_softmax (temperature 1)."""
    top_logprobs: int = 0
    """Also return, per step, the ids and log-probs of the this-many most likely tokens (same distribution as
    the chosen token's log-prob)."""
    keep_weights: bool = False
    """Keep the engine's weights after the call even with `rollout.free_during_train=kv_cache_and_weights`: an eval,
    between a push and the step's rollout, which frees them for the train phase as usual."""

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


def next_token(logits: Tensor, temperature: float, top_p: float, keys: Tensor, step: int,
               greedy: bool = False) -> tuple[Tensor, Tensor]:
    """The chosen token of each row [B] and the log-probs [B, V] it was chosen from: log_softmax(logits / T)
    sampled with top-p, row i's noise keyed by (`keys[i]`, `step`) as in `sample_from_logits`, or, greedy, the
    argmax under the plain log_softmax(logits)."""
    if greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp.argmax(dim=-1), logp
    steps = torch.full_like(keys, step)
    token, _ = sample_from_logits(logits, temperature, top_p, keys, steps)
    return token, torch.log_softmax(logits.float() / temperature, dim=-1)


def sample_from_logits(logits: Tensor, temperature: float, top_p: float, keys: Tensor, steps: Tensor,
                       race=None, noise=None) -> tuple[Tensor, Tensor]:
    """One token per row and its log-probability under the full softmax at `temperature` (the trainer's
    definition, before top-p). Row i's noise is keyed by (`keys[i]`, `steps[i]`) (`keyed_exponential`).

    The exponential race `argmax(p / E)`, `E ~ Exp(1)` i.i.d., picks i with probability p_i / sum(p): a
    categorical sample with static shapes and no host sync. Without top-p it is `argmax(logits / T - log E)`
    (`race`, which a caller may pass compiled: the noise, the race and the log-sum-exp in one pass over the
    logits, no [B, V] softmax); with top-p, `noise` may be the compiled `keyed_exponential`.
    """
    if top_p >= 1.0:
        return (race or exponential_race)(logits, keys, steps, temperature)
    draws = (noise or keyed_exponential)(keys, steps, logits.shape[-1])
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    token = torch.argmax(top_p_filter(logp.exp(), top_p) / draws, dim=-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def sample_from_hidden(hidden: Tensor, head_weight: Tensor, temperature: float, top_p: float, keys: Tensor,
                       steps: Tensor, race=None, noise=None, fused: bool | None = None,
                       softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """`sample_from_logits` on the head's logits `F.linear(hidden, head_weight)` (soft-capped, `cap * tanh(x /
    cap)`, with `softcap`), for the final-normed `hidden` [B, H]. Without top-p and with `fused` (None: wherever
    `sampled_head.available`), the head GEMM and the race run as one Triton pass over the head's weight
    (`rlspec.rollout.sampled_head`), which never writes the [B, V] logits: the race over the same logits up to the
    GEMM's accumulation order. Otherwise the logits are formed and sampled as `sample_from_logits` samples them
    (`race`, `noise`: its compiled pieces). `temperature` 0: greedy, the argmax and its plain log_softmax (as
    `next_token(greedy=True)`)."""
    if fused is None:
        fused = sampled_head.available(hidden.device)
    if fused and top_p >= 1.0 and softcap is None and temperature > 0:
        return sampled_head.sampled_head(hidden, head_weight, keys, steps, temperature)
    logits = F.linear(hidden, head_weight)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature == 0:
        logp = torch.log_softmax(logits.float(), dim=-1)
        token = logp.argmax(dim=-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    return sample_from_logits(logits, temperature, top_p, keys, steps, race, noise)


def exponential_race(logits: Tensor, keys: Tensor, steps: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """`argmax(softmax(logits / T) / E)` and the winner's log-probability, without forming the softmax.

    Each row's vocabulary is reduced in `vocab_splits` parts (each part's best score and its index; the log-sum-exp
    by `logsumexp_in_parts`), then the parts are combined, so the compiled race and the log-sum-exp read the logits in one
    kernel (at 64 rows x 152k on an H100: 98 us in three kernels before, 78 us now, bound by the noise's
    hashing). The winner is the same as a whole-row argmax: the first part holding the maximum, then the
    first maximum in it."""
    vocab = logits.shape[-1]
    parts = vocab_splits(vocab)
    scaled = logits.float() / temperature
    score = (scaled - keyed_exponential(keys, steps, vocab).log()).unflatten(-1, (parts, -1))
    part_best, part_index = score.max(dim=-1)
    best = part_best.argmax(dim=-1, keepdim=True)
    token = (best * (vocab // parts) + part_index.gather(-1, best)).squeeze(-1)
    lse, _ = logsumexp_in_parts(scaled)
    return token, scaled.gather(-1, token[:, None]).squeeze(-1) - lse
