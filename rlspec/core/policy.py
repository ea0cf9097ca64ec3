"""Model-side glue shared by every backend: forward to token log-probs, and the micro-batch loss loop.

Backends differ in how they wrap the model (plain, FSDP2, ZeRO-3) and how they call backward; the
forward, the loss (`rlspec.core.grpo`) and the accumulation of statistics are this one code path.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .batch import TrainBatch, position_ids
from .grpo import LossConfig, LossNorm, policy_loss, token_logprobs_and_entropy

STAT_KEYS = ("loss", "clipped_tokens", "kl_sum", "tokens", "entropy_sum", "is_ratio_sum", "is_clipped_tokens")


# Causal LMs whose logits are exactly `lm_head(final hidden states)` (no soft-capping or logit scale).
PLAIN_HEAD_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


def forward_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                     temperature: float) -> tuple[Tensor, Tensor]:
    """Token log-probs and (detached) entropies, as `token_logprobs` / `token_entropy` define them.

    A plain transformers model (or its PEFT wrapper) runs its decoder here and the LM head chunk by chunk
    inside `token_logprobs_and_entropy`, so the batch's full logits are never materialised; a model
    wrapped by a backend (ZeRO-3 engine, FSDP2) goes through its own forward.
    """
    split = _decoder_and_head(model)
    if split is None:
        return token_logprobs_and_entropy(forward_logits(model, input_ids, attention_mask), input_ids, temperature)
    decoder, head = split
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                     use_cache=False).last_hidden_state
    return token_logprobs_and_entropy(hidden, input_ids, temperature, head=head)


def _decoder_and_head(model: torch.nn.Module):
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        base = model
    elif type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
        base = model.get_base_model()
    else:
        return None  # a backend's wrapper (e.g. a ZeRO-3 engine) runs its own forward
    if not isinstance(base, PreTrainedModel) or getattr(base.config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    if any(cls.__name__ == "FSDPModule" for cls in type(base).__mro__):
        return None  # FSDP2 gathers the root's weights in the root's forward only
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear:  # e.g. a LoRA-wrapped head
        return None
    return base.get_decoder(), head


def forward_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                   pixel_values: Tensor | None = None) -> Tensor:
    """Logits of a causal LM (or, with `pixel_values`, an image-text-to-text model) on right- or left-padded
    sequences (positions count real tokens only)."""
    images = {} if pixel_values is None else {"pixel_values": pixel_values.to(getattr(model, "dtype", pixel_values.dtype))}
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids(attention_mask), use_cache=False, **images)
    return out.logits


def restrict_vocab(logits: Tensor, input_ids: Tensor, vocab: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Logits over each sequence's own token subset `vocab` [N, A]: returns the [N, L, A] logits, the ids of
    `input_ids` as indices into `vocab`, and where a token is in `vocab` at all ([N, L] bool)."""
    n, length = input_ids.shape
    sub = logits.gather(-1, vocab[:, None, :].expand(n, length, vocab.shape[-1]))
    match = input_ids[..., None] == vocab[:, None, :]
    return sub, match.long().argmax(-1), match.any(-1)


def sequence_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float) -> tuple[Tensor, Tensor]:
    """[N, L] log-probs of `batch`'s tokens and the (detached) entropies of the distributions they come from.

    With `batch.action_vocab` the distribution is the softmax over those ids only; a token outside them
    (a prompt token) gets log-prob 0. A text batch takes `forward_logprobs` (no full logits).
    """
    if batch.pixel_values is None and batch.action_vocab is None:
        return forward_logprobs(model, batch.input_ids, batch.attention_mask, temperature)
    logits = forward_logits(model, batch.input_ids, batch.attention_mask, batch.pixel_values)
    if batch.action_vocab is None:
        return token_logprobs_and_entropy(logits, batch.input_ids, temperature)
    logits, ids, member = restrict_vocab(logits, batch.input_ids, batch.action_vocab)
    logp, entropy = token_logprobs_and_entropy(logits, ids, temperature)
    return logp * member.to(logp.dtype), entropy


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float, micro_batch_size: int,
                   device: torch.device | str) -> Tensor:
    """[N, L] token log-probs of `batch` under `model`, computed micro-batch by micro-batch, returned on CPU
    (gathered on `device`, then copied once)."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=device)
    for start, mb in zip(range(0, len(batch), micro_batch_size), batch.micro_batches(micro_batch_size, device)):
        logp, _ = sequence_logprobs(model, mb, temperature)
        out[start:start + len(mb), :mb.input_ids.shape[1]] = logp.float()
    return out.cpu()


def micro_batch_loss(model: torch.nn.Module, mb: TrainBatch, norm: LossNorm, cfg: LossConfig,
                     temperature: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Forward one micro-batch and return its GRPO loss share and statistic sums (0-dim device tensors)."""
    logp, entropy = sequence_logprobs(model, mb, temperature)
    old = mb.old_logprobs if mb.old_logprobs is not None else logp.detach()
    loss, stats = policy_loss(logp, old.to(logp.dtype), mb.advantages, mb.loss_mask.to(logp.dtype), norm, cfg,
                              None if mb.ref_logprobs is None else mb.ref_logprobs.to(logp.dtype),
                              None if mb.engine_logprobs is None else mb.engine_logprobs.to(logp.dtype))
    with torch.no_grad():
        stats["entropy_sum"] = (entropy * mb.loss_mask).sum()
        stats["loss"] = loss.detach()
    return loss, stats


def accumulate(model: torch.nn.Module, shard: TrainBatch, micro_batch_size: int, norm: LossNorm, cfg: LossConfig,
               temperature: float, backward: Callable[[Tensor], None], device: torch.device | str) -> dict[str, float]:
    """Run forward + `backward(loss)` over `shard` in micro-batches; return summed statistics.

    `backward` receives the loss share of each micro-batch (see `rlspec.core.grpo.aggregate`): the caller
    scales it for its gradient reduction (e.g. x world size under an averaging all-reduce).

    The statistics stay on the device, summed in fp64 (what adding them as Python floats gives), and are
    read once at the end: the loop itself never waits for the device.
    """
    totals = None
    for mb in shard.micro_batches(micro_batch_size, device):
        loss, stats = micro_batch_loss(model, mb, norm, cfg, temperature)
        backward(loss)
        part = torch.stack([stats[key].detach().to(torch.float64) for key in STAT_KEYS])
        totals = part if totals is None else totals + part
    if totals is None:
        return dict.fromkeys(STAT_KEYS, 0.0)
    return dict(zip(STAT_KEYS, totals.tolist()))


def add_stats(*parts: dict[str, float]) -> dict[str, float]:
    """Sum statistic dicts (e.g. from several ranks)."""
    return {key: sum(p[key] for p in parts) for key in STAT_KEYS}
