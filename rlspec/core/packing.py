"""Where a micro-batch's tokens go: packed into one row, and how a batch splits into micro-batches and ranks.

Packing: a micro-batch of n right-padded sequences [n, L] runs its forward as one row [1, T] of its real
tokens only (T = sum of the lengths), sequence after sequence, with positions restarting at 0 for each
sequence; the attention is kept within each sequence (`rlspec.core.policy` says how). `Packing` holds the
index arithmetic, computed on the host before the batch moves, so the device never has to be asked where
the real tokens are.

Split (`plan_split`, for `algorithm.micro_batch_tokens`): the step's rows go to the data-parallel ranks by
length, longest first, each to the rank with the fewest real tokens so far (ties: the lower rank); each rank
then packs its rows, longest first, into micro-batches of at most `micro_batch_tokens` real tokens, each row
into the first micro-batch it fits (first-fit decreasing; a row longer than the budget is a micro-batch of
its own). That gives the fewest micro-batches, but full ones and a small remainder: the rows are then dealt
again over that many micro-batches, longest first, each to the one with the fewest tokens so far, and kept so
where no micro-batch passes the budget. Every micro-batch then carries about as much work: a small last one
costs the host a full forward and backward's launches for a fraction of the GPU work, and the GPU waited on it
(256 rows of 276 tokens under a 16k budget: four micro-batches of 59 rows and one of 20 first-fit, five of 51-52
dealt again; on one H100 at 32 x 8 and a 32k budget the train phase took 0.58 and 0.56 s against 0.62 and 0.63 s,
its peak memory 26.5 GB against 37.0, `python -m rlspec.perf.profile_train --split`). A sharded model's
forward and backward are collective, so every rank must run as many micro-batches as the rank with the most: the
others add placeholder micro-batches (size 0, see `rlspec.core.batch.TrainBatch.placeholder`) whose loss and
gradient are exactly 0.
"""

from __future__ import annotations

import functools
import heapq
import inspect
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Packing:
    """A micro-batch [n, L] packed into one row of its T real tokens."""

    index: Tensor
    """[T] where each real token sits in the micro-batch, as a flat index `row * L + column`."""
    position_ids: Tensor
    """[1, T] each token's position within its own sequence (real tokens counted, from 0)."""
    sequence: Tensor
    """[T] which of the micro-batch's sequences each token belongs to."""
    cu_seqlens: Tensor
    """[n + 1] int32 offsets of the sequences in the packed row (what varlen attention kernels take)."""
    max_length: int
    """The longest sequence's length."""
    shape: tuple[int, int]
    """(n, L) of the padded micro-batch."""

    @property
    def first(self) -> Tensor:
        """[T] bool: the first token of its sequence (it has no prefix, so no log-prob)."""
        return self.position_ids[0] == 0

    def gather(self, padded: Tensor) -> Tensor:
        """[1, T] of a token-aligned [n, L] tensor."""
        return padded.reshape(-1)[self.index].unsqueeze(0)

    def scatter(self, packed: Tensor) -> Tensor:
        """[n, L] of a packed [T] tensor, zero at padding (differentiable)."""
        n, length = self.shape
        return packed.new_zeros(n * length).index_copy(0, self.index, packed).view(n, length)


def pack_all(masks: list[Tensor], device: torch.device | str) -> list[Packing]:
    """The `Packing` of each micro-batch's host attention mask [n_i, L_i], moved in one copy per kind."""
    longs, offsets, shapes, lengths_all = [], [], [], []
    for mask in masks:
        real = mask.bool()
        lengths = real.sum(-1)
        index = real.reshape(-1).nonzero().squeeze(1)
        positions = (real.long().cumsum(-1) - 1).reshape(-1)[index]
        sequence = torch.repeat_interleave(torch.arange(real.shape[0]), lengths)
        longs.append(torch.stack([index, positions, sequence]))
        offsets.append(torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32))
        shapes.append(tuple(real.shape))
        lengths_all.append(lengths)
    if not masks:
        return []
    flat = torch.cat(longs, dim=1).to(device)
    cu_all = torch.cat(offsets).to(device)
    out, token_at, cu_at = [], 0, 0
    for part, cu, shape, lengths in zip(longs, offsets, shapes, lengths_all):
        tokens = part.shape[1]
        view = flat[:, token_at:token_at + tokens]
        out.append(Packing(view[0], view[1].unsqueeze(0), view[2], cu_all[cu_at:cu_at + len(cu)],
                           int(lengths.max()) if len(lengths) else 0, shape))
        token_at += tokens
        cu_at += len(cu)
    return out


def chunk_sizes(num_rows: int, size: int) -> list[int]:
    """Consecutive micro-batches of `size` rows (the last one shorter): the row-count split."""
    return [min(size, num_rows - start) for start in range(0, num_rows, size)]


def plan_split(lengths: list[int], world_size: int, micro_batch_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The token-budget split (module docstring): per rank, its rows (indices into `lengths`, in micro-batch
    order) and its micro-batch sizes in rows (0 = a placeholder); every rank has as many micro-batches."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rank_rows: list[list[int]] = [[] for _ in range(world_size)]
    rank_tokens = [0] * world_size
    for row in order:
        rank = min(range(world_size), key=lambda r: (rank_tokens[r], r))
        rank_rows[rank].append(row)
        rank_tokens[rank] += lengths[row]
    plans = [_balanced(_first_fit(rows, lengths, micro_batch_tokens), lengths, micro_batch_tokens)
             for rows in rank_rows]
    count = max(len(bins) for bins in plans)
    return [([row for b in bins for row in b], [len(b) for b in bins] + [0] * (count - len(bins))) for bins in plans]


def _first_fit(rows: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """`rows` (longest first) into micro-batches of at most `budget` tokens, each row into the first that has room
    (a row longer than the budget alone)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in rows:
        fits = next((b for b, free in enumerate(room) if lengths[row] <= free), None)
        if fits is None:
            bins.append([row])
            room.append(budget - lengths[row])
        else:
            bins[fits].append(row)
            room[fits] -= lengths[row]
    return bins


def _balanced(bins: list[list[int]], lengths: list[int], budget: int) -> list[list[int]]:
    """The rows of `bins` dealt again over as many micro-batches, longest first, each to the one with the fewest
    tokens so far (ties: the first), so that they are near equal instead of full ones and a remainder; `bins`
    as they are where that would pass the budget (or put an over-long row beside another)."""
    if len(bins) < 2:
        return bins
    dealt: list[list[int]] = [[] for _ in bins]
    fewest = [(0, b) for b in range(len(bins))]  # a heap of (tokens so far, micro-batch): O(log k) a row
    for row in sorted((r for b in bins for r in b), key=lambda r: (-lengths[r], r)):
        tokens, target = fewest[0]
        dealt[target].append(row)
        heapq.heapreplace(fewest, (tokens + lengths[row], target))
    if all(tokens <= budget or len(dealt[b]) == 1 for tokens, b in fewest):
        return dealt
    return bins


PACKED_SDPA = "rlspec_packed_sdpa"
"""The attention implementation an `sdpa` model is switched to for packed forwards (`packed_sdpa_attention`)."""


def use_packed_sdpa(config) -> None:
    """Switch an `sdpa` model's config to `PACKED_SDPA` (registered with transformers on first use): unpacked
    forwards (generation, the padded path) still run transformers' sdpa with its masks, unchanged."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if PACKED_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
        AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    config._attn_implementation = PACKED_SDPA


def packed_sdpa_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """transformers' sdpa attention, except in a packed forward (`cu_seq_lens_q` given, [1, heads, T, dim]):
    there, on CUDA in 16 bits, torch's varlen flash kernel, which computes each sequence's causal block only;
    elsewhere sdpa under the block-diagonal causal mask built from the offsets (all T x T scores)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    offsets = kwargs.get("cu_seq_lens_q")
    if offsets is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and dropout == 0.0 and varlen_usable():
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, dim]
        return varlen_causal(q, k, v, offsets, kwargs["max_length_q"], scaling).unsqueeze(0), None
    mask = packed_causal_mask(offsets, query.shape[2])
    return sdpa_attention_forward(module, query, key, value, mask[None, None], dropout=dropout, scaling=scaling,
                                  **kwargs)


def packed_causal_mask(offsets: Tensor, length: int, key_offsets: Tensor | None = None,
                       key_length: int | None = None) -> Tensor:
    """[length, length] bool: each token of a packed row sees its own sequence's tokens up to itself (`offsets`
    [n + 1] the sequences' starts and the end; tokens past the end form one more block). With `key_offsets` [n + 1]
    (an extension, `rollout.decoder.Packed`): [length, key_length], sequence i's queries the last of its keys, each
    query seeing its sequence's keys up to its own place counted from the end (without, keys are the queries, and
    that is the causal mask)."""

    def to_end(bounds: Tensor, count: int) -> tuple[Tensor, Tensor]:  # each token's sequence, tokens after it there
        places = torch.arange(count, device=bounds.device, dtype=bounds.dtype)
        sequence = torch.searchsorted(bounds[1:], places, right=True)
        ends = torch.cat([bounds[1:], bounds[-1:].clamp(min=count)])  # the block past the end runs to `count`
        return sequence, ends[sequence] - 1 - places

    q_sequence, q_after = to_end(offsets, length)
    k_sequence, k_after = (q_sequence, q_after) if key_offsets is None else to_end(key_offsets, key_length)
    return (q_sequence[:, None] == k_sequence[None, :]) & (k_after[None, :] >= q_after[:, None])


def varlen_causal(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, longest: int, scale: float | None,
                  key_offsets: Tensor | None = None, key_longest: int | None = None) -> Tensor:
    """Causal varlen attention of [T, heads, dim] tensors (`offsets` int32 [n + 1]; `longest` at least the longest
    sequence), across the torch versions that have it (the causal flag and grouped-query heads were spelt
    differently at first). `key_offsets`, `key_longest`: keys of their own (an extension: each sequence's queries
    are the last of its keys; the kernel aligns causal attention to the end when the two lengths differ)."""
    varlen_attn, window, gqa = _varlen()
    options = {"scale": scale} | ({"window_size": (-1, 0)} if window else {"is_causal": True})
    if key_offsets is None:
        key_offsets, key_longest = offsets, longest
    if q.shape[1] != k.shape[1]:
        if gqa:
            options["enable_gqa"] = True
        elif not (torch.is_grad_enabled() and q.requires_grad) and _flash_forward() is not None:
            # Inference (the serving pool's prefills and extensions): the flash kernel's own grouped-query heads, where
            # this torch's varlen_attn takes none. Repeating K/V per query head instead writes and reads the keys
            # 7x over for the 0.5B shape: on an H200, 0.9 of a 1-row extension's 5.2 ms of device time, 3.6 of an
            # 8-row one's 10.2.
            return _flash_forward()(q, k, v, offsets, key_offsets, longest, key_longest, 0.0, True, False,
                                    scale=scale)[0]
        else:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, offsets, key_offsets, longest, key_longest, **options)


def varlen_usable() -> bool:
    """torch has its varlen flash attention (>= 2.10; CUDA only)."""
    return _varlen() is not None


@functools.cache
def _flash_forward():
    """ATen's flash forward (`varlen_attn`'s kernel, which takes fewer K/V heads than query heads), or None."""
    return getattr(torch.ops.aten, "_flash_attention_forward", None)


@functools.cache
def _varlen():
    """torch's varlen flash attention and whether it spells causal as a window and takes grouped-query heads, or
    None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "window_size" in params, "enable_gqa" in params
