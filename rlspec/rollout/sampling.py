"""Sampling pieces shared by the plain loop (`hf`), the CUDA-graph sampler (`static`) and the env rollouts."""

from __future__ import annotations

import torch
from torch import Tensor


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Zero the tail outside the smallest set of tokens whose mass reaches `top_p` (rows need not renormalise)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keeps at least the most likely token
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
