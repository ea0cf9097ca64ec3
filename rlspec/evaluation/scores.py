"""The metrics of one eval, from its samples laid out prompt after prompt (k samples each).

With n scored samples of a prompt (a sample whose reward failed is left out and counted in `eval/reward_errors`):
- mean@k: the mean reward over every sample;
- best@k: per prompt the highest reward, averaged over prompts;
- pass@k: per prompt the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k) with c the samples that
  pass, averaged over prompts (a prompt with fewer than k scored samples is left out);
- maj@k: per prompt the reward of the first sample whose extracted answer is the most common one (ties: the answer
  seen first; no answer extracted at all: the first sample's reward), averaged over prompts;
- response_len/mean: completion tokens per sample; truncated_frac: the share of samples that ran into
  rollout.max_new_tokens without an end token.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class Sample:
    reward: float
    """NaN where the reward failed."""
    length: int
    truncated: bool
    answer: Optional[str] = None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass: 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarise(samples: Sequence[Sample], k: int, pass_ks: Sequence[int], pass_threshold: float | None,
              majority: bool, sources: Sequence[str] | None = None) -> dict[str, float]:
    """`eval/<metric>` over every prompt, and `eval/<source>/<metric>` per source when `sources` (one per prompt)."""
    groups = [list(samples[i:i + k]) for i in range(0, len(samples), k)]
    metrics = {f"eval/{name}": value for name, value in _metrics(groups, k, pass_ks, pass_threshold, majority).items()}
    metrics["eval/num_prompts"] = float(len(groups))
    metrics["eval/reward_errors"] = float(sum(math.isnan(s.reward) for s in samples))
    if sources is not None:
        for source in sorted(set(sources)):
            mine = [g for g, s in zip(groups, sources) if s == source]
            for name, value in _metrics(mine, k, pass_ks, pass_threshold, majority).items():
                metrics[f"eval/{source}/{name}"] = value
    return metrics


def _metrics(groups: list[list[Sample]], k: int, pass_ks: Sequence[int], threshold: float | None,
             majority: bool) -> dict[str, float]:
    scored = [[s for s in g if not math.isnan(s.reward)] for g in groups]
    rewards = [s.reward for g in scored for s in g]
    out = {f"mean@{k}": _mean(rewards), f"best@{k}": _mean([max(s.reward for s in g) for g in scored if g])}
    for n in pass_ks:
        out[f"pass@{n}"] = _mean([pass_at_k(len(g), sum(_passes(s.reward, threshold) for s in g), n)
                                  for g in scored if len(g) >= n])
    if majority and k > 1:
        out[f"maj@{k}"] = _mean([_majority(g) for g in scored if g])
    every = [s for g in groups for s in g]
    out["response_len/mean"] = _mean([float(s.length) for s in every])
    out["truncated_frac"] = _mean([float(s.truncated) for s in every])
    return out


def _passes(reward: float, threshold: float | None) -> bool:
    return reward > 0 if threshold is None else reward >= threshold


def _majority(group: list[Sample]) -> float:
    votes = Counter(s.answer for s in group if s.answer is not None)
    if not votes:
        return group[0].reward
    top = max(votes.values())
    winner = next(s.answer for s in group if s.answer is not None and votes[s.answer] == top)
    return next(s.reward for s in group if s.answer == winner)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
