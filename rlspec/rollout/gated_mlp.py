"""`silu(x @ Wg.T) * (x @ Wu.T)` for the decode step's few rows: the gate/up GEMM with the SiLU gate in its epilogue.

A decode step's MLP otherwise runs one cuBLAS GEMM over the fused [2F, H] gate/up weight (`StaticDecoder.fuse_weights`:
rows [0, F) gate, [F, 2F) up), writing gate and up [M, 2F], then an element-wise kernel for silu(gate) * up. Here
each program owns `BLOCK_N` output columns j and accumulates both the gate rows j and the up rows F + j over the
whole of K = H in fp32 (one read of each x block serves both), so y [M, F] is formed in the GEMM's epilogue: one
kernel where there were two, and neither gate/up [M, 2F] written nor read back. No split-K: the epilogue is not
linear in the parts, and K is short (896 for the 0.5B shape).

The epilogue follows what the layer computed before, to the rounding: gate and up are rounded to the model dtype
(the cuBLAS GEMM's bf16 outputs), then y = g / (1 + exp(-g)) * u in fp32 (Inductor's SiLU, whose intermediate
is not rounded) and y rounded to the model dtype once.

Needs Triton and a CUDA device (`available`); the decoder keeps the cuBLAS path otherwise
(`StaticDecoder._mlp_block`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .live_attention import triton
from .live_attention import triton_runs_on as available  # whether this kernel runs on a device (callers ask here)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gated_mlp(x_ptr, w_ptr, out_ptr, M, N, K, sx_m, sw_n, so_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
        # M blocks on the fastest axis: programs sharing a weight block run side by side (its reread hits L2)
        m_block = tl.program_id(0)
        n_block = tl.program_id(1)
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + ks
            x = tl.load(x_ptr + rows[:, None] * sx_m + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                        other=0.0)
            w_mask = (cols[:, None] < N) & (k[None, :] < K)  # also keeps columns past N off the up rows' end
            wg = tl.load(w_ptr + cols[:, None] * sw_n + k[None, :], mask=w_mask, other=0.0)
            wu = tl.load(w_ptr + (N + cols[:, None]) * sw_n + k[None, :], mask=w_mask, other=0.0)
            gate += tl.dot(x, tl.trans(wg))
            up += tl.dot(x, tl.trans(wu))
        dtype = out_ptr.dtype.element_ty
        g = gate.to(dtype).to(tl.float32)
        u = up.to(dtype).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + rows[:, None] * so_m + cols[None, :], y.to(dtype),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))


def config_for(m: int) -> dict:
    """Tiles of 16 or 64 rows (as `skinny_linear.config_for`) by 32 columns (each program reading 64 weight rows,
    gate and up), the whole of K in blocks of 128, 4 warps, 3 stages: in a sweep on one H100 at the 0.5B shape
    (`python -m rlspec.perf.bench_decode_kernels`), the fastest at 16 rows (9.5 us against 10.3-10.5 with 16
    columns) and level with the best at 64 rows (10.6-10.7 us for 16 or 32 columns, 4 warps; 8 warps, 256-deep K
    blocks or 32-row tiles were slower)."""
    return {"block_m": 16 if m <= 16 else 64, "block_n": 32, "block_k": 128, "warps": 4, "stages": 3}


def _launch(launch, x: Tensor, weight: Tensor, block_m: int, block_n: int, block_k: int, warps: int = 4,
            stages: int = 3) -> Tensor:
    m, k = x.shape
    n = weight.shape[0] // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    launch(_gated_mlp)[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def gated_mlp_eager(x: Tensor, weight: Tensor, **config) -> Tensor:
    """The kernel launched directly (tests, kernel timings): x [M, K] (K contiguous), weight [2F, K] -> [M, F]."""
    return _launch(lambda kernel: kernel, x, weight, **config)


if triton is not None:
    @torch.library.triton_op("rlspec::gated_mlp", mutates_args=())
    def _gated_mlp_op(x: Tensor, weight: Tensor, block_m: int, block_n: int, block_k: int, warps: int,
                      stages: int) -> Tensor:
        from torch.library import wrap_triton
        return _launch(wrap_triton, x, weight, block_m, block_n, block_k, warps, stages)


def gated_mlp(x: Tensor, weight: Tensor) -> Tensor:
    """`silu(g) * u` where `g, u = F.linear(x, weight).chunk(2, -1)`, for x [..., K] with few rows and the fused
    gate/up weight [2F, K]: [..., F] in x's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    config = config_for(flat.shape[0])
    return torch.ops.rlspec.gated_mlp(flat, weight, **config).reshape(*x.shape[:-1], weight.shape[0] // 2)
