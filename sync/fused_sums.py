"""`checksums` of many CUDA tensors in one kernel launch (Triton), bit for bit what `sync.base.checksums` computes
tensor by tensor.

A tensor's checksum is Σ_i word[i] · col[i mod P] · row[i div P] modulo 2**32 (`sync.base._weighted`: its words as
int32, P = `WEIGHT_PERIOD`). Integer sums modulo 2**32 do not depend on their order, so the words of every tensor
can be cut into blocks of `BLOCK` words, each block weighted and summed by one program, and the blocks' sums added
into their tensor's checksum atomically: one launch for a whole bucket, where the per-tensor reductions took a few
launches per tensor (339 tensors of the 7B shape: 68 ms of the sender's host time in a verified push, two H200s).

Which block belongs to which tensor, and where it starts, depends only on the tensors' sizes and is kept per set
of sizes; their addresses are kept per set of addresses (an engine's weights stay put, so a captured graph can
replay the kernel; a trainer's export brings new ones each push, a copy of one int64 per tensor).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install: the per-tensor reductions
    triton = None

BLOCK = 8192
"""Words per program."""
KEPT = 128
"""Block tables (and address tables) kept, the least recently used dropped past it: a push checksums each bucket
with its own (a 7B model in 256 MB buckets has about 60), a few hundred KB each."""
_blocks: "OrderedDict[tuple, tuple[Tensor, Tensor, Tensor]]" = OrderedDict()
_addresses: "OrderedDict[tuple, Tensor]" = OrderedDict()


if triton is not None:
    @triton.jit
    def _weighted_blocks(addresses, owners, starts, counts, cols, rows, out, PERIOD: tl.constexpr,
                         BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        owner = tl.load(owners + pid)
        start = tl.load(starts + pid)
        count = tl.load(counts + pid)
        words = tl.load(addresses + owner).to(tl.pointer_type(tl.int32))
        index = start + tl.arange(0, BLOCK).to(tl.int64)
        mask = index < start + count
        word = tl.load(words + index, mask=mask, other=0)
        col = tl.load(cols + index % PERIOD, mask=mask, other=0)
        row = tl.load(rows + index // PERIOD, mask=mask, other=0)
        tl.atomic_add(out + owner, tl.sum(word * col * row, axis=0).to(tl.int32))


def usable(words: Tensor | None, device: torch.device) -> bool:
    """Whether `fused_checksums` takes this word view (`sync.base.word_views`): Triton here, and aligned int32
    words on CUDA `device`."""
    return triton is not None and words is not None and words.dtype == torch.int32 and words.device == device \
        and device.type == "cuda"


def tables(words: list[Tensor]) -> tuple[Tensor, ...]:
    """What `fused_checksums` launches with for these word views: which block belongs to which tensor, where it
    starts and how many words it holds (kept per set of sizes), and the tensors' addresses (kept per set of
    addresses). A captured graph must hold its own (`sync.staging.BucketChecksums` does): these caches drop old
    entries."""
    device = words[0].device
    return (*_block_table(tuple(w.numel() for w in words), device),
            _address_table(tuple(w.data_ptr() for w in words), device))


def fused_checksums(words: list[Tensor], cols: Tensor, rows: Tensor, period: int,
                    launch: tuple[Tensor, ...] | None = None) -> Tensor:
    """One int32 checksum per word view (each 1-D int32, `usable`), enqueued with no host sync; `launch`: the
    views' `tables`, if already at hand."""
    owners, starts, counts, addresses = tables(words) if launch is None else launch
    out = torch.zeros(len(words), dtype=torch.int32, device=words[0].device)
    if owners.numel():
        _weighted_blocks[(owners.numel(),)](addresses, owners, starts, counts, cols, rows, out, PERIOD=period,
                                            BLOCK=BLOCK, num_warps=8)
    return out


def _block_table(sizes: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Per block: the tensor it belongs to, its first word's index in that tensor, its word count."""
    def make() -> tuple[Tensor, Tensor, Tensor]:
        sizes_t = torch.tensor(sizes, dtype=torch.int64)
        per = (sizes_t + BLOCK - 1) // BLOCK
        owners = torch.repeat_interleave(torch.arange(len(sizes)), per)
        first = torch.cumsum(per, 0) - per  # each tensor's first block
        starts = (torch.arange(int(per.sum())) - first[owners]) * BLOCK
        counts = torch.clamp(sizes_t[owners] - starts, max=BLOCK)
        return tuple(_to_device(t, device) for t in (owners, starts, counts))

    return _kept(_blocks, sizes, device, make)


def _address_table(pointers: tuple[int, ...], device: torch.device) -> Tensor:
    return _kept(_addresses, pointers, device, lambda: _to_device(torch.tensor(pointers, dtype=torch.int64), device))


def _kept(cache: OrderedDict, key: tuple, device: torch.device, make):
    """`cache`'s entry for `key` on `device` and the current stream (`_to_device` says why per stream), made by
    `make()` when missing; the least recently used dropped past `KEPT`."""
    key = (key, device, torch.cuda.current_stream(device).cuda_stream)
    if key not in cache:
        cache[key] = make()
    cache.move_to_end(key)
    while len(cache) > KEPT:
        cache.popitem(last=False)
    return cache[key]


def _to_device(table: Tensor, device: torch.device) -> Tensor:
    """`table` on `device`, copied from pinned memory without waiting: a plain copy would wait for everything
    enqueued before it (a trainer's export checksums each bucket while the previous one is on the wire). So the
    tables are kept per stream: one copied on another stream might not have landed yet."""
    return table.pin_memory().to(device, non_blocking=True)
