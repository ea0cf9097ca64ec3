r"""GRPO advantage and loss — the one implementation every backend calls.

Notation: a rollout batch holds P prompts x G completions; sequence i has completion tokens
t in T_i (the `loss_mask`), reward r_i, and belongs to group g(i).

Advantage (one scalar per sequence, broadcast to its tokens)::

    group_std:  A_i = (r_i - mean_g(r)) / (std_g(r) + eps)      std unbiased (Bessel), eps = 1e-6
    none:       A_i =  r_i - mean_g(r)                          (Dr. GRPO, Liu et al. 2025)

verl uses the same unbiased std with eps 1e-6; TRL uses eps 1e-4 (set `algorithm.adv_eps`).

Dropped samples (a reward that could not be obtained): mean and std run over the group's kept members
K_g only, and a dropped sample gets A_i = 0 and no loss tokens. A group left with |K_g| < 2 members is
dropped whole, since one member has no baseline (see `kept_samples`).

Per-token policy loss, with ratio rho = exp(logp - logp_old)::

    l_t = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))          (PPO clip; DAPO's clip-higher
                                                                          when eps_high > eps_low)
    if dual_clip_c and A < 0:  l_t = min(l_t, -A c)                      (dual-clip, Ye et al. 2020)
    if tis_cap:  l_t = w_t l_t,  w_t = min(exp(logp_old - logp_engine), tis_cap)    (no gradient through w_t)
    l_t += beta * KL_t   with  k1: KL_t = logp - logp_ref
                               k3: KL_t = exp(logp_ref - logp) - (logp_ref - logp) - 1

Aggregation over the batch B behind one optimizer step (`algorithm.loss_agg`)::

    token-mean                 L = sum_i sum_{t in T_i} l_t / sum_i |T_i|
    seq-mean-token-mean        L = (1/|B|) sum_i (1/|T_i|) sum_{t in T_i} l_t     (the GRPO paper)
    seq-mean-token-sum-norm    L = (1/|B|) sum_i sum_{t in T_i} l_t / L_max        (Dr. GRPO)

Dr. GRPO's L_max is a constant no |T_i| can exceed: the plan's `batch.max_trained_tokens`, which is
`rollout.max_new_tokens`, or for a multi-turn agent (`rollout.agent`), whose every turn's sampled tokens are
trained, `rollout.agent.max_turns x rollout.max_new_tokens` (a turn samples at most max_new_tokens). The paper
divides by the generation budget, a constant; verl divides by the width of its response tensor
(`loss_mask.shape[-1]`: the configured response length where responses are padded to it, multi-turn ones
included) unless `loss_scale_factor` sets the constant.

Truncated importance sampling (TIS, as in verl; Yao et al. 2025): the engine sampled from its own
policy mu — older weights in `rollout.mode=async`, or different numerics (bf16, another kernel) — while
the clipped term corrects only from pi_old (the trainer's policy at the start of the update, which is
pi_theta detached with one update per batch). Weighting each token by the capped ratio pi_old / mu
makes the gradient an estimate under mu's samples; the cap bounds its variance. The KL term is not
weighted. The ratio is measured whenever the engine's log-probs are present, and applied only when
`algorithm.tis_cap` is set.

Deviations and choices, stated: the default aggregation is token-mean (verl's and TRL's default, not the
paper's seq-mean-token-mean); the KL term is added to the loss (as in the paper and TRL), not to the
reward; with one update per rollout batch, rho = 1 and the clip is inactive (the loss gradient is then
the plain policy gradient); the paper's per-step re-sampling is unchanged.

Distribution: `aggregate` divides by *global* counts (`LossNorm`, computed over the whole optimizer
step's batch on every rank and micro-batch), so summing the per-micro-batch losses over micro-batches
and ranks gives exactly L. A backend whose gradient reduction averages over W ranks multiplies its
local loss by W before backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import fused_head

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossNorm:
    """Global denominators for one optimizer step, identical on every rank and micro-batch."""

    num_tokens: int
    """Completion tokens in the whole step's batch (all ranks, all micro-batches)."""
    num_sequences: int
    """Sequences with at least one completion token in the whole step's batch (a dropped sample, or a row
    that only pads a batch to an even split over ranks, has none)."""
    max_new_tokens: int
    """Dr. GRPO's constant L_max: the trained-token budget of a sequence (the plan's `batch.max_trained_tokens`)."""

    @staticmethod
    def of(loss_mask: Tensor, max_new_tokens: int) -> "LossNorm":
        return LossNorm(int(loss_mask.sum().item()), int((loss_mask.sum(-1) > 0).sum().item()), max_new_tokens)


@dataclass(frozen=True)
class LossConfig:
    """The algorithm knobs the loss reads (a projection of `AlgorithmSpec`)."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip_c: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    loss_agg: str = "token-mean"
    tis_cap: float | None = None

    @staticmethod
    def from_algorithm(algo) -> "LossConfig":
        return LossConfig(algo.clip_eps_low, algo.clip_eps_high, algo.dual_clip_c, algo.kl_coef,
                          algo.kl_estimator, algo.loss_agg, algo.tis_cap)


def kept_samples(valid: Tensor, group_size: int) -> Tensor:
    """[P * G] bool: samples whose reward was obtained, in groups that still hold at least two of them."""
    grouped = valid.bool().view(-1, group_size)
    return (grouped & (grouped.sum(dim=1, keepdim=True) >= 2)).view(-1)


def group_advantages(rewards: Tensor, group_size: int, norm: str = "group_std", eps: float = 1e-6,
                     kept: Tensor | None = None) -> Tensor:
    """Per-sequence advantages for rewards laid out group after group (shape [P * G]).

    `kept` ([P * G] bool, see `kept_samples`) restricts each group's mean and std to its kept members;
    the others get 0 (their rewards may be NaN). A group whose (kept) rewards are all equal gets exactly 0:
    in floating point its mean can differ from the rewards by an ulp, which `group_std` would blow up into
    advantages of up to ~0.1, all of one sign — a push on every sampled token where there is nothing to learn.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size}")
    if norm not in ("group_std", "none"):
        raise ValueError(f"unknown advantage normalisation {norm!r}")
    if kept is not None and not bool(kept.all()):
        return _masked_group_advantages(rewards, group_size, norm, eps, kept)
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm == "group_std":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    tied = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return torch.where(tied, 0.0, centred).view(-1)


def _masked_group_advantages(rewards: Tensor, group_size: int, norm: str, eps: float, kept: Tensor) -> Tensor:
    mask = kept.bool().view(-1, group_size)
    grouped = torch.where(mask, rewards.float().view(-1, group_size), 0.0)
    count = mask.sum(dim=1, keepdim=True)
    mean = grouped.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(mask, grouped - mean, 0.0)
    if norm == "group_std":
        std = ((centred ** 2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    high = torch.where(mask, grouped, -torch.inf).amax(dim=1, keepdim=True)
    low = torch.where(mask, grouped, torch.inf).amin(dim=1, keepdim=True)
    return torch.where(high <= low, 0.0, centred).view(-1)


def ragged_group_advantages(rewards: Tensor, group_sizes: list[int], norm: str = "group_std",
                            eps: float = 1e-6, kept: Tensor | None = None) -> Tensor:
    """`group_advantages` for groups of different sizes laid out one after another (e.g. after an agent's failed
    trajectories were dropped); each group is normalised over its own (kept) members."""
    if sum(group_sizes) != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards do not form groups of sizes {group_sizes}")
    parts = rewards.float().split(list(group_sizes))
    kept_parts = kept.split(list(group_sizes)) if kept is not None else [None] * len(parts)
    return torch.cat([group_advantages(part, len(part), norm, eps, k) for part, k in zip(parts, kept_parts)])


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate from log-probs of the sampled tokens."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        log_ratio = ref_logp - logp
        return torch.exp(log_ratio) - log_ratio - 1
    raise ValueError(f"unknown KL estimator {estimator!r}")


def aggregate(per_token: Tensor, loss_mask: Tensor, mode: str, norm: LossNorm) -> Tensor:
    """This shard's share of the batch aggregate: summed over shards it is the `loss_agg` formula above."""
    masked = per_token * loss_mask
    if mode == "token-mean":
        return masked.sum() / max(norm.num_tokens, 1)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / loss_mask.sum(dim=-1).clamp(min=1)
        return per_seq.sum() / norm.num_sequences
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (norm.num_sequences * norm.max_new_tokens)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, loss_mask: Tensor, norm: LossNorm,
                cfg: LossConfig, ref_logp: Tensor | None = None,
                engine_logp: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped GRPO loss of one shard (tensors [N, L] token-aligned; `advantages` [N]).

    `engine_logp` are the rollout engine's log-probs of the sampled tokens (for TIS). Returns the loss
    share (see `aggregate`) and *sums* over this shard's completion tokens, so that statistics add up
    across micro-batches and ranks: `clipped_tokens`, `kl_sum`, `tokens`, `is_ratio_sum` (pi_old / mu),
    `is_clipped_tokens` (ratio above `tis_cap`). The sums are 0-dim tensors on the loss's device, so that a
    micro-batch loop reads them once per step (`read_stats`), not once per micro-batch (each read waits for
    the device).
    """
    adv = advantages.unsqueeze(-1).to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if cfg.dual_clip_c is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * cfg.dual_clip_c), per_token)
    is_ratio = None
    if engine_logp is not None:
        # outside completions the engine has no log-prob; the masked log-ratio 0 keeps exp() finite there
        is_ratio = torch.exp(((old_logp - engine_logp) * loss_mask).detach())
        if cfg.tis_cap is not None:
            per_token = per_token * torch.clamp(is_ratio, max=cfg.tis_cap)
    kl = None
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        kl = kl_penalty(logp, ref_logp, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
    loss = aggregate(per_token, loss_mask, cfg.loss_agg, norm)
    with torch.no_grad():
        mask = loss_mask > 0
        zero = loss_mask.new_zeros(())
        stats = {
            "clipped_tokens": ((clipped > unclipped) & mask).sum(),
            "kl_sum": (kl * loss_mask).sum() if kl is not None else zero,
            "tokens": mask.sum(),
            "is_ratio_sum": (is_ratio * loss_mask).sum() if is_ratio is not None else zero,
            "is_clipped_tokens": (((is_ratio > cfg.tis_cap) & mask).sum()
                                  if is_ratio is not None and cfg.tis_cap is not None else zero),
        }
    return loss, stats


def read_stats(stats: dict[str, Tensor]) -> dict[str, float]:
    """Statistic tensors as floats, in one device-to-host read; fp64, so a sum of fp32 sums is what adding
    them as Python floats gives."""
    values = torch.stack([v.detach().to(torch.float64) for v in stats.values()]).tolist()
    return dict(zip(stats, values))


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log p(input_ids[:, t] | input_ids[:, :t]) at `temperature`, aligned with `input_ids` (column 0 is 0)."""
    logp = torch.log_softmax(_at_least_fp32(logits[:, :-1]) / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the next-token distribution at `temperature`, aligned like `token_logprobs`."""
    logp = torch.log_softmax(_at_least_fp32(logits[:, :-1]) / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(entropy, (1, 0))


CHUNK_ELEMS = 1 << 25
"""Logits per chunk of `token_logprobs_and_entropy` on the plain path (fp32 copies of each chunk's logits)."""
FUSED_CHUNK_ELEMS = 1 << 27
"""Logits per chunk on the fused path, which keeps no fp32 copies (`rlspec.perf.bench_head` times one such chunk)."""


def token_logprobs_and_entropy(states: Tensor, input_ids: Tensor, temperature: float = 1.0,
                               head: torch.nn.Module | None = None, chunk_elems: int | None = None,
                               fused: bool | None = None) -> tuple[Tensor, Tensor]:
    """`token_logprobs` and `token_entropy` (entropy detached), computed over chunks of positions.

    `states` are the logits [N, L, V], or with `head` (a `Linear`) the final hidden states [N, L, H] and
    `head(h)` the logits, so the full logits never exist: at a 152k vocabulary a batch of 64 x 270 tokens is
    5 GB of bf16 logits and 10 GB per fp32 intermediate. Each chunk holds at most `chunk_elems` logits, and
    backward recomputes a chunk's logits from its states (`_ChunkedLogprobs`) rather than keeping them.

    Two ways to run a chunk (`fused`; by default fused exactly for a head on CUDA in 16 bits, the train path
    on a GPU):
    - plain: fp32 log_softmax, gather and entropy as `token_logprobs` / `token_entropy` write them. The
      log-softmax is row-wise, so chunked log-probs and entropies are bit-identical to the plain ones; an
      input that fits one chunk takes exactly the unchunked ops (gradients included). The CPU and fp32 path,
      which the conformance suite compares bit for bit.
    - fused (`_head_stats`, `_head_grad`): the same math in fp32 read from the 16-bit logits, keeping the
      row's log-sum-exp for backward, whose logits gradient is one elementwise pass. On CUDA these are Triton
      kernels that read a chunk's logits once each and write the gradient over them
      (`rlspec.core.fused_head`), or without Triton the two functions torch.compile'd. A chunk then costs a few
      passes over its 16-bit logits instead of about ten over fp32 copies, which made the head's elementwise
      work as slow as the whole model's matmuls (measured: 0.35 of 0.92 s of kernels in a 32 x 8 train
      phase); with no fp32 copies a chunk may hold 4x the logits. Equal to plain up to fp32 summation order.
    """
    targets = input_ids[:, 1:]
    rows, length = targets.shape
    vocab = head.weight.shape[0] if head is not None else states.shape[-1]
    if fused is None:
        fused = head is not None and states.is_cuda and states.dtype in (torch.bfloat16, torch.float16)
    if chunk_elems is None:
        chunk_elems = FUSED_CHUNK_ELEMS if fused else CHUNK_ELEMS
    chunk = max(1, chunk_elems // max(rows * vocab, 1))
    if length <= chunk and not fused:
        logits = states if head is None else head(states)
        picked, entropy = _chunk_logprobs(logits[:, :-1], targets, temperature)
    else:
        weight = None if head is None else head.weight
        bias = None if head is None else head.bias
        picked, entropy = _ChunkedLogprobs.apply(states[:, :-1], weight, bias, targets, temperature, chunk, fused)
    return torch.nn.functional.pad(picked, (1, 0)), torch.nn.functional.pad(entropy, (1, 0))


def _chunk_logprobs(states: Tensor, targets: Tensor, temperature: float,
                    head=None) -> tuple[Tensor, Tensor]:
    # The fp32 logits are dropped once the log-softmax has run, and the entropy reuses exp(logp) in place:
    # a chunk's peak is two fp32 copies of its logits, not four.
    logits = _at_least_fp32(states if head is None else head(states))
    logp = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)  # x / 1.0 == x
    del logits
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp().mul_(logp)).sum(-1)
    return picked, entropy


def _head_stats(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """The fused chunk's forward: log p(target), the entropy and the log-sum-exp of z = logits / T, per row.
    log p_t = z_t - lse; H = -sum_j p_j (z_j - lse) = lse - sum_j p_j z_j.

    Both come from `logsumexp_in_parts`: as one reduction per row, compiled, a chunk of ~900 rows x 152k took
    2 ms (a quarter of a 32 x 8 train phase's kernels); in parts it runs on all SMs.
    """
    z = _at_least_fp32(logits) / temperature
    lse, mean = logsumexp_in_parts(z, with_mean=True)
    picked = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    return picked, lse - mean, lse


def logsumexp_in_parts(z: Tensor, with_mean: bool = False) -> tuple[Tensor, Tensor | None]:
    """log-sum-exp of `z` over its last dimension and, `with_mean`, sum_j softmax(z)_j z_j (else None), reduced
    in `vocab_splits` parts: each part's max m, sum e^(z - m) (and sum z e^(z - m)), then the parts combined, so
    a row's reduction becomes many short ones."""
    parts = z.unflatten(-1, (vocab_splits(z.shape[-1]), -1))
    part_max = parts.amax(-1)
    exp = torch.exp(parts - part_max.unsqueeze(-1))
    top = part_max.amax(-1, keepdim=True)
    scale = torch.exp(part_max - top)
    total = (exp.sum(-1) * scale).sum(-1)
    mean = ((exp * parts).sum(-1) * scale).sum(-1) / total if with_mean else None
    return top.squeeze(-1) + torch.log(total), mean


def vocab_splits(vocab: int, shortest: int = 1024, most: int = 64) -> int:
    """The largest power of two <= `most` that divides `vocab` into parts of >= `shortest` entries (1 if none):
    how many parts a row's reduction over the vocabulary is split into, so that a few rows still fill the GPU."""
    splits = 1
    while splits * 2 <= most and vocab % (splits * 2) == 0 and vocab // (splits * 2) >= shortest:
        splits *= 2
    return splits


def _head_grad(logits: Tensor, targets: Tensor, lse: Tensor, grad_picked: Tensor, temperature: float) -> Tensor:
    """The fused chunk's backward: d loss / d logits = g (onehot(t) - softmax(z)) / T, in the logits' dtype."""
    z = _at_least_fp32(logits) / temperature
    hit = torch.arange(logits.shape[-1], device=logits.device) == targets.unsqueeze(-1)
    grad = (hit.to(z.dtype) - torch.exp(z - lse.unsqueeze(-1))) * (grad_picked.to(z.dtype) / temperature).unsqueeze(-1)
    return grad.to(logits.dtype)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """`fn` under torch.compile, made once per process. Automatic-dynamic: compiled for the first chunk's shape,
    then once more with what changed (positions in a shorter last chunk, rows) symbolic, while the vocabulary
    stays a constant. Fully dynamic (`dynamic=True`), the kernels were about twice as slow: on one H100 at a
    chunk of 883 x 152k bf16 logits, 0.656 -> 0.388 ms for `_head_stats` and 0.521 -> 0.262 ms for `_head_grad`
    (`python -m rlspec.perf.bench_head`; a copy of the same logits took 0.188 ms)."""
    return torch.compile(fn, dynamic=None)


def _head_kernel(fn: Callable, on_cuda: bool) -> Callable:
    return _compiled(fn) if on_cuda else fn  # eager elsewhere: the CPU tests check the math, not the compiler


class _ChunkedLogprobs(torch.autograd.Function):
    """Log-probs and entropies of states [N, L, H] under `logits = states @ weight.T + bias` (or of logits
    [N, L, V] when `weight` is None), `positions` columns at a time, plain or fused
    (`token_logprobs_and_entropy`).

    Forward keeps only the states (and, fused, each row's log-sum-exp); backward recomputes each chunk's
    logits, takes the gradient d logp_t / d z = (onehot(t) - softmax(z / T)) / T through the chunk and adds the
    weight's share in place. So a chunk's logits live only while that chunk runs, and the weight gradient is
    one buffer rather than one full-size tensor per chunk that autograd would sum (under
    `torch.utils.checkpoint` it also kept each chunk's graph machinery and ran the forward's entropy again).
    """

    @staticmethod
    def forward(ctx, states, weight, bias, targets, temperature, positions, fused=False):
        head = (lambda x: x) if weight is None else (lambda x: torch.nn.functional.linear(x, weight, bias))
        pieces = zip(states.split(positions, dim=1), targets.split(positions, dim=1))
        if fused:
            parts = [_fused_stats(head(piece), target, temperature) for piece, target in pieces]
            lse = torch.cat([part[2] for part in parts], dim=1)
        else:
            parts = [_chunk_logprobs(piece, target, temperature, None if weight is None else head)
                     for piece, target in pieces]
            lse = None
        ctx.save_for_backward(states, weight, bias, targets, lse)
        ctx.temperature, ctx.positions, ctx.fused = temperature, positions, fused
        picked, entropy = torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)
        ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_picked, _grad_entropy):
        states, weight, bias, targets, lse = ctx.saved_tensors
        temperature, step = ctx.temperature, ctx.positions
        grad_states = torch.empty_like(states) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        for start in range(0, states.shape[1], step):
            cols = slice(start, start + step)
            piece = states[:, cols]
            out_dtype = states.dtype if weight is None else weight.dtype
            if ctx.fused and weight is not None and fused_head.available(piece):
                logits = torch.nn.functional.linear(piece, weight, bias)
                grad = fused_head.head_logits_grad_(logits.flatten(0, 1), targets[:, cols].flatten(),
                                                    lse[:, cols].flatten(), grad_picked[:, cols].flatten(),
                                                    temperature).view(logits.shape)
                del logits
            elif ctx.fused:
                logits = piece if weight is None else torch.nn.functional.linear(piece, weight, bias)
                grad = _head_kernel(_head_grad, states.is_cuda)(logits, targets[:, cols], lse[:, cols],
                                                                 grad_picked[:, cols], temperature).to(out_dtype)
                del logits
            else:
                grad = _plain_logits_grad(piece, weight, bias, targets[:, cols], grad_picked[:, cols], temperature,
                                          out_dtype)
            if weight is None:
                if grad_states is not None:
                    grad_states[:, cols] = grad
                continue
            if grad_states is not None:
                grad_states[:, cols] = torch.matmul(grad, weight)
            grad = grad.flatten(0, 1)
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), piece.flatten(0, 1))
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        return grad_states, grad_weight, grad_bias, None, None, None, None


def _fused_stats(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """`_head_stats` of one chunk's logits [N, C, V]: through the Triton kernels where they take them
    (`rlspec.core.fused_head`), else compiled."""
    if fused_head.available(logits):
        stats = fused_head.head_stats(logits.flatten(0, 1), targets.flatten(), temperature)
        return tuple(part.view(targets.shape) for part in stats)
    return _head_kernel(_head_stats, logits.is_cuda)(logits, targets, temperature)


def _plain_logits_grad(piece: Tensor, weight: Tensor | None, bias: Tensor | None, targets: Tensor,
                       grad_picked: Tensor, temperature: float, out_dtype: torch.dtype) -> Tensor:
    # The backward autograd runs for gather then log_softmax (then / T), op for op, so the gradients are
    # autograd's bit for bit; a chunk's peak is three fp32 copies of its logits, as before.
    logits = _at_least_fp32(piece if weight is None else torch.nn.functional.linear(piece, weight, bias))
    logp = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    del logits
    grad = torch.zeros_like(logp).scatter_(-1, targets.unsqueeze(-1), grad_picked.to(logp.dtype).unsqueeze(-1))
    grad = torch.ops.aten._log_softmax_backward_data(grad, logp, -1, logp.dtype)
    del logp
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(out_dtype)


def _at_least_fp32(t: Tensor) -> Tensor:
    """bf16/fp16 logits are upcast before log_softmax (as verl and TRL do); fp64 stays fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
