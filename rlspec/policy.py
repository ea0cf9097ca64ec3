"""Model-side glue shared by every backend: forward to token log-probs, and the micro-batch loss loop.

Backends differ in how they wrap the model (plain, FSDP2, ZeRO-3) and how they call backward; the
forward, the loss (`rlspec.grpo`) and the accumulation of statistics are this one code path.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .batch import TrainBatch, position_ids
from .grpo import LossConfig, LossNorm, policy_loss, token_logprobs_and_entropy

STAT_KEYS = ("loss", "clipped_tokens", "kl_sum", "tokens", "entropy_sum")


def forward_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Logits of a causal LM on right- or left-padded sequences (positions count real tokens only)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids(attention_mask), use_cache=False)
    return out.logits


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float, micro_batch_size: int,
                   device: torch.device | str) -> Tensor:
    """[N, L] token log-probs of `batch` under `model`, computed micro-batch by micro-batch, on CPU."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for start in range(0, len(batch), micro_batch_size):
        mb = batch.select(start, start + micro_batch_size).trimmed().to(device)
        logits = forward_logits(model, mb.input_ids, mb.attention_mask)
        logp, _ = token_logprobs_and_entropy(logits, mb.input_ids, temperature)
        out[start:start + len(mb), :mb.input_ids.shape[1]] = logp.float().cpu()
    return out


def micro_batch_loss(model: torch.nn.Module, mb: TrainBatch, norm: LossNorm, cfg: LossConfig,
                     temperature: float) -> tuple[Tensor, dict[str, float]]:
    """Forward one micro-batch and return its GRPO loss share and statistic sums."""
    logits = forward_logits(model, mb.input_ids, mb.attention_mask)
    logp, entropy = token_logprobs_and_entropy(logits, mb.input_ids, temperature)
    old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
    loss, stats = policy_loss(logp, old.to(logp.dtype), mb.advantages, mb.loss_mask.to(logp.dtype), norm, cfg,
                              None if mb.ref_logprobs is None else mb.ref_logprobs.to(logp.dtype))
    with torch.no_grad():
        stats["entropy_sum"] = float((entropy * mb.loss_mask).sum().item())
        stats["loss"] = float(loss.item())
    return loss, stats


def accumulate(model: torch.nn.Module, shard: TrainBatch, micro_batch_size: int, norm: LossNorm, cfg: LossConfig,
               temperature: float, backward: Callable[[Tensor], None], device: torch.device | str) -> dict[str, float]:
    """Run forward + `backward(loss)` over `shard` in micro-batches; return summed statistics.

    `backward` receives the loss share of each micro-batch (see `rlspec.grpo.aggregate`): the caller
    scales it for its gradient reduction (e.g. x world size under an averaging all-reduce).
    """
    totals = dict.fromkeys(STAT_KEYS, 0.0)
    for mb in shard.chunks(micro_batch_size):
        loss, stats = micro_batch_loss(model, mb.trimmed().to(device), norm, cfg, temperature)
        backward(loss)
        for key in STAT_KEYS:
            totals[key] += stats[key]
    return totals


def add_stats(*parts: dict[str, float]) -> dict[str, float]:
    """Sum statistic dicts (e.g. from several ranks)."""
    return {key: sum(p[key] for p in parts) for key in STAT_KEYS}
