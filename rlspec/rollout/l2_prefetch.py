"""Weights pulled into L2 ahead of the decode kernels that read them, on a side stream of the captured step.

At a few rows a decode step's kernels are short of the memory bandwidth: each layer's seven kernels take a few
microseconds apiece, most of it latency (the launch, the first loads from DRAM, the split-K sums), and a layer's
weights (29.7 MB for the 0.5B shape) are read in bursts with the memory idle in between. Here a kernel on a second
stream, forked inside the captured graph, issues bulk L2 prefetches (`cp.async.bulk.prefetch.L2`, Hopper and
later: one instruction per `CHUNK` bytes, no registers or shared memory held while the data moves) for the
weights the main stream reads next, so the bytes move while the latency-bound kernels run, and the GEMMs then read
from L2. The prefetch is a hint: it changes no value, and the captured step joins the side stream at its end.

`PrefetchTable` holds the chunk addresses of each stretch of weights (for the decoder: layer i's MLP with layer
i + 1's attention), built on the host from the tensors' storage; `prefetch` launches one kernel over a stretch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .live_attention import triton, triton_runs_on

CHUNK = 16384  # bytes per prefetch instruction
BLOCK = 128    # chunks per program

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _prefetch_chunks(addresses_ptr, sizes_ptr, count, BLOCK: tl.constexpr):
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        index = tl.minimum(index, count - 1)  # a block's spare lanes repeat the last chunk (a hint: harmless)
        address = tl.load(addresses_ptr + index)
        size = tl.load(sizes_ptr + index)
        tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tcp.async.bulk.prefetch.L2.global [$1], $2;", "=r,l,r",
                                  [address, size], dtype=tl.int32, is_pure=False, pack=1)


def available(device: torch.device) -> bool:
    """Bulk L2 prefetches need Triton and a CUDA device of compute capability 9.0 or later."""
    device = torch.device(device)
    return triton_runs_on(device) and torch.cuda.get_device_capability(device)[0] >= 9


def chunks(tensors: list[Tensor], chunk: int = CHUNK) -> tuple[list[int], list[int]]:
    """Start addresses and byte counts of `chunk`-byte pieces covering each tensor's storage span (the last piece
    of a tensor shorter; every count a multiple of 16, as the instruction requires, rounded down)."""
    addresses, sizes = [], []
    for tensor in tensors:
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for offset in range(0, nbytes, chunk):
            size = min(chunk, nbytes - offset) // 16 * 16
            if size:
                addresses.append(start + offset)
                sizes.append(size)
    return addresses, sizes


def pointers(stretches: list[list[Tensor]]) -> tuple[int, ...]:
    """The storage addresses a table of `stretches` was built from (a re-allocated weight needs a new table)."""
    return tuple(t.data_ptr() for tensors in stretches for t in tensors)


class PrefetchTable:
    """The chunks of each stretch of weights, on the device: stretch s is `stretches[s]`, a list of tensors."""

    def __init__(self, stretches: list[list[Tensor]], device: torch.device, chunk: int = CHUNK) -> None:
        self.pointers = pointers(stretches)
        bounds, addresses, sizes = [0], [], []
        for tensors in stretches:
            a, s = chunks(tensors, chunk)
            addresses += a
            sizes += s
            bounds.append(len(addresses))
        self.bounds = bounds
        self.addresses = torch.tensor(addresses, dtype=torch.int64, device=device)
        self.sizes = torch.tensor(sizes, dtype=torch.int32, device=device)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def prefetch(self, stretch: int) -> None:
        """Issue stretch `stretch`'s prefetches on the current stream."""
        first, last = self.bounds[stretch], self.bounds[stretch + 1]
        count = last - first
        if count:
            _prefetch_chunks[(triton.cdiv(count, BLOCK),)](self.addresses[first:], self.sizes[first:], count,
                                                           BLOCK=BLOCK, num_warps=4)
