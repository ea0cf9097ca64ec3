"""The training batch every backend consumes: right-padded sequences with token-aligned tensors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from .packing import Packing, chunk_sizes, pack_all, plan_split


TOKEN_ALIGNED = ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "ref_logprobs", "engine_logprobs")
"""The [N, L] fields (the others are per sequence, [N] or [N, ...])."""


@dataclass
class TrainBatch:
    """N sequences of prompt + completion, right-padded to a common length L.

    Token-aligned tensors have shape [N, L]; column t of a log-prob tensor is log p(input_ids[:, t] | prefix).
    """

    input_ids: Tensor
    """[N, L] token ids (prompt then completion, pad after)."""
    attention_mask: Tensor
    """[N, L] 1 on real tokens."""
    loss_mask: Tensor
    """[N, L] 1 on completion tokens (the ones the loss sees)."""
    advantages: Tensor
    """[N] one advantage per sequence."""
    rewards: Tensor
    """[N] scalar rewards (for logging)."""
    old_logprobs: Tensor | None = None
    """[N, L] log-probs of the policy that sampled the batch, as recomputed by the trainer."""
    ref_logprobs: Tensor | None = None
    """[N, L] reference-policy log-probs (only when algorithm.kl_coef > 0)."""
    engine_logprobs: Tensor | None = None
    """[N, L] the rollout engine's log-probs of the sampled tokens, zero outside completions (for TIS)."""
    pixel_values: Tensor | None = None
    """[N, C, H, W] one image per sequence, as the model's processor makes it (`model.kind: vla`)."""
    action_vocab: Tensor | None = None
    """[N, A] token ids a completion token is drawn from (the action tokens); log-probs and entropy are then
    over these ids only, and 0 at tokens outside them. None: the whole vocabulary."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def _map(self, fn) -> "TrainBatch":
        return TrainBatch(**{f.name: (None if (v := getattr(self, f.name)) is None else fn(v))
                             for f in dataclasses.fields(self)})

    def select(self, start: int, stop: int) -> "TrainBatch":
        """Sequences [start, stop)."""
        return self._map(lambda t: t[start:stop])

    def to(self, device: torch.device | str) -> "TrainBatch":
        return self._map(lambda t: t.to(device))

    def trimmed(self, length: int | None = None) -> "TrainBatch":
        """Drop trailing columns that are padding in every sequence (saves compute per micro-batch); `length`,
        when the caller knows it, saves reading it from the mask."""
        if length is None:
            length = self.real_length()
        return TrainBatch(**{f.name: (t[:, :length] if f.name in TOKEN_ALIGNED and t is not None else t)
                             for f in dataclasses.fields(self) for t in [getattr(self, f.name)]})

    def real_length(self) -> int:
        """Columns up to the last one that holds a real token in some sequence."""
        return int(self.attention_mask.sum(dim=0).nonzero().max().item()) + 1

    def micro_batches(self, size: int, device: torch.device | str) -> Iterator["TrainBatch"]:
        """`chunks(size)`, each `trimmed()`, on `device` (see `split`)."""
        for mb, _ in self.split(chunk_sizes(len(self), size), device):
            yield mb

    def split(self, sizes: list[int], device: torch.device | str,
              packed: bool = False) -> Iterator[tuple["TrainBatch", "Packing | None"]]:
        """Consecutive micro-batches of `sizes[i]` sequences, each `trimmed()`, on `device`, with their `Packing`
        when `packed`. A size of 0 is a placeholder micro-batch (see `placeholder`), for a rank that must run as
        many forwards as the others.

        The batch moves in one copy per tensor and the lengths and packings are read where the batch is, before
        it moves: on a GPU, no micro-batch waits for the device to drain (a copy from pageable host memory, or
        `.item()` on a device tensor, would)."""
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        parts = [self.select(a, a + n) if n else self.placeholder() for a, n in zip(starts, sizes)]
        lengths = [mb.real_length() for mb in parts]
        packings = pack_all([mb.attention_mask[:, :n] for mb, n in zip(parts, lengths)], device) if packed \
            else [None] * len(parts)
        moved = self.to(device)
        for a, n, length, packing in zip(starts, sizes, lengths, packings):
            yield (moved.select(a, a + n) if n else moved.placeholder()).trimmed(length), packing

    def placeholder(self) -> "TrainBatch":
        """One real token of the first sequence and no loss tokens: a micro-batch whose loss and gradient are
        exactly 0, but whose forward and backward take part in a sharded model's collectives."""
        one = self.select(0, 1).trimmed(1)
        one.attention_mask = torch.ones_like(one.attention_mask)
        one.loss_mask = torch.zeros_like(one.loss_mask)
        return one

    def take(self, rows: list[int]) -> "TrainBatch":
        """Sequences `rows`, in that order."""
        index = torch.tensor(rows, dtype=torch.long)
        return self._map(lambda t: t[index])

    def lengths(self) -> list[int]:
        """Real tokens of each sequence (read on the host: call it before the batch moves)."""
        return self.attention_mask.sum(dim=-1).tolist()

    def chunks(self, size: int) -> Iterator["TrainBatch"]:
        """Consecutive slices of at most `size` sequences."""
        for start in range(0, len(self), size):
            yield self.select(start, min(start + size, len(self)))

    def shard(self, rank: int, world_size: int) -> "TrainBatch":
        """This rank's contiguous share (the plan guarantees an even split)."""
        per_rank = len(self) // world_size
        return self.select(rank * per_rank, (rank + 1) * per_rank)

    def row_shards(self, world_size: int, micro_batch_size: int) -> list[tuple["TrainBatch", list[int]]]:
        """Contiguous shares of a batch whose rows do not divide by `world_size` (an agent's), as equal as the rows
        allow, each with its micro-batch sizes in rows (`micro_batch_size` each, 0 = a placeholder) so that every
        rank runs as many micro-batches; a rank left without rows gets the first row, as placeholders only."""
        bounds = [(len(self) * r // world_size, len(self) * (r + 1) // world_size) for r in range(world_size)]
        sizes = [chunk_sizes(stop - start, micro_batch_size) for start, stop in bounds]
        count = max(len(s) for s in sizes)
        return [(self.select(start, stop) if stop > start else self.select(0, 1), s + [0] * (count - len(s)))
                for (start, stop), s in zip(bounds, sizes)]

    def token_shards(self, world_size: int, micro_batch_tokens: int) -> list[tuple["TrainBatch", list[int]]]:
        """The token-budget split (`rlspec.core.packing.plan_split`): per rank, its sequences (in micro-batch
        order) and its micro-batch sizes, for `rlspec.core.policy.accumulate`. Read on the host."""
        return [(self.take(rows), sizes) for rows, sizes in plan_split(self.lengths(), world_size, micro_batch_tokens)]

    def tensors(self) -> dict[str, Tensor]:
        """The non-empty fields, e.g. for safetensors or a Ray object."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    @staticmethod
    def from_tensors(tensors: dict[str, Tensor]) -> "TrainBatch":
        return TrainBatch(**tensors)


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only (what generation uses with left padding)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)
