"""`x @ W.T` for the decode step's few rows: a split-K Triton GEMM whose partial sums the caller adds.

At 16-256 rows cuBLAS reads the decoder's smaller weight matrices far below the memory bandwidth (for the 0.5B
shape at 64 rows, q/k/v and the output projection at about 0.4 TB/s, gate/up 1.8 and down 0.9 TB/s on an
H100, with a different weight per layer so none stays in L2): too few output tiles to occupy the SMs. Here the
K dimension is also cut into `splits` parts, one program per (N block, part, M block), each writing its fp32
partial sum; `skinny_linear` returns the [splits, M, N] partials, and the caller adds them part by part
(`StaticDecoder._summed`), which torch.compile fuses into the element-wise kernel that reads the output next
(the residual add, the next norm), so the split costs no extra kernel where such a kernel follows
(`StaticDecoder._linear_parts` says where it is used).
Deterministic: no atomics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .live_attention import sm_count, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _skinny_linear_parts(x_ptr, w_ptr, out_ptr, M, N, K, sx_m, sw_n, CHUNK: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n_block = tl.program_id(0)
        split = tl.program_id(1)
        m_block = tl.program_id(2)
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(split * CHUNK, tl.minimum(split * CHUNK + CHUNK, K), BLOCK_K):
            k = start + ks
            x = tl.load(x_ptr + rows[:, None] * sx_m + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + cols[:, None] * sw_n + k[None, :], mask=(cols[:, None] < N) & (k[None, :] < K),
                        other=0.0)
            acc += tl.dot(x, tl.trans(w))
        tl.store(out_ptr + (split * M + rows[:, None]) * N + cols[None, :], acc,
                 mask=(rows[:, None] < M) & (cols[None, :] < N))


def config_for(m: int, n: int, k: int, sms: int) -> dict:
    """Tiles of 16 or 64 rows by 32 columns, 128-deep K blocks, and K cut into parts until there are about two
    programs per SM (at most one K block a part): the fastest in a one-off sweep of tile sizes on an H100 for the
    0.5B shape's q/k/v, output and down projections at 16 and 64 rows. `tests/gpu/measure.sh decode_kernels` times
    this choice beside cuBLAS."""
    block_m, block_n, block_k = (16 if m <= 16 else 64), 32, 128
    tiles = -(-n // block_n) * -(-m // block_m)
    splits = max(1, min(-(-2 * sms // tiles), k // block_k))
    return {"splits": splits, "block_m": block_m, "block_n": block_n, "block_k": block_k}


def _launch(launch, x: Tensor, weight: Tensor, splits: int, block_m: int, block_n: int, block_k: int,
            warps: int = 4, stages: int = 3) -> Tensor:
    m, k = x.shape
    n = weight.shape[0]
    chunk = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k  # each part a whole number of K blocks
    splits = triton.cdiv(k, chunk)
    out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    launch(_skinny_linear_parts)[(triton.cdiv(n, block_n), splits, triton.cdiv(m, block_m))](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), CHUNK=chunk, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def skinny_linear_eager(x: Tensor, weight: Tensor, **config) -> Tensor:
    """The kernel launched directly (tests, kernel timings): [splits, M, N] fp32 partial sums."""
    return _launch(lambda kernel: kernel, x, weight, **config)


if triton is not None:
    @torch.library.triton_op("rlspec::skinny_linear", mutates_args=())
    def _skinny_linear_op(x: Tensor, weight: Tensor, splits: int, block_m: int, block_n: int,
                          block_k: int) -> Tensor:
        from torch.library import wrap_triton
        return _launch(wrap_triton, x, weight, splits, block_m, block_n, block_k)


def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` for x [..., K] with few rows, as fp32 parts [splits, ..., N] for the caller to
    add (the bias added to the first)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    config = config_for(flat.shape[0], weight.shape[0], weight.shape[1], sm_count(x.device.index or 0))
    out = torch.ops.rlspec.skinny_linear(flat, weight, **config)
    if bias is not None:
        out = torch.cat([out[:1] + bias, out[1:]])
    return out.reshape(out.shape[0], *x.shape[:-1], weight.shape[0])
