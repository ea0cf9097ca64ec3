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

With `pdl` (Hopper and later: `dependent_launch`) each program asks L2 for its gate and up rows before waiting for
the kernel ahead, so that read overlaps the kernel ahead.

Needs Triton and a CUDA device (`available`); the decoder keeps the cuBLAS path otherwise
(`StaticDecoder._mlp_block`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dependent_launch import launch_options, line_elements
from .live_attention import triton
from .live_attention import triton_runs_on as available  # whether this kernel runs on a device (callers ask here)

if triton is not None:
    import triton.language as tl

    from .dependent_launch import prefetch_l2, wait_for_inputs

    @triton.jit
    def _gated_mlp(x_ptr, w_ptr, out_ptr, M, N, K, sx_m, sw_n, so_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr,
                   LINES: tl.constexpr):
        # M blocks on the fastest axis: programs sharing a weight block run side by side (its reread hits L2)
        m_block = tl.program_id(0)
        n_block = tl.program_id(1)
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        if PREFETCH:  # the gate and up rows [BLOCK_N, K] each, one address per L2 line (clamped inside W)
            lines = tl.minimum(tl.arange(0, LINES) * LINE, K - 1)
            gate_rows = w_ptr + tl.minimum(cols, N - 1)[:, None] * sw_n + lines[None, :]
            prefetch_l2(gate_rows)
            prefetch_l2(gate_rows + N * sw_n)
        wait_for_inputs(PDL)
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


def _launch(x: Tensor, weight: Tensor, block_m: int, block_n: int, block_k: int, warps: int = 4, stages: int = 3,
            pdl: bool = False, prefetch: bool = True) -> Tensor:
    """`prefetch`: with `pdl`, ask L2 for the weights before waiting (False only to time what that brings)."""
    m, k = x.shape
    n = weight.shape[0] // 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    line = line_elements(weight)
    _gated_mlp[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, PDL=pdl, PREFETCH=pdl and prefetch, LINE=line,
        LINES=triton.next_power_of_2(triton.cdiv(k, line)), num_warps=warps, num_stages=stages, **launch_options(pdl))
    return out


def gated_mlp_eager(x: Tensor, weight: Tensor, **config) -> Tensor:
    """The kernel launched directly (tests, kernel timings): x [M, K] (K contiguous), weight [2F, K] -> [M, F]."""
    return _launch(x, weight, **config)


if triton is not None:
    # A custom op that launches the kernel itself (`skinny_linear` says why not a `triton_op`)
    @torch.library.custom_op("rlspec::gated_mlp", mutates_args=())
    def _gated_mlp_op(x: Tensor, weight: Tensor, block_m: int, block_n: int, block_k: int, warps: int,
                      stages: int, pdl: bool) -> Tensor:
        return _launch(x, weight, block_m, block_n, block_k, warps, stages, pdl)

    @_gated_mlp_op.register_fake
    def _(x: Tensor, weight: Tensor, block_m: int, block_n: int, block_k: int, warps: int, stages: int,
          pdl: bool) -> Tensor:
        return x.new_empty(x.shape[0], weight.shape[0] // 2)


def gated_mlp(x: Tensor, weight: Tensor, pdl: bool = False) -> Tensor:
    """`silu(g) * u` where `g, u = F.linear(x, weight).chunk(2, -1)`, for x [..., K] with few rows and the fused
    gate/up weight [2F, K]: [..., F] in x's dtype. `pdl`: launch dependently (`dependent_launch`)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    config = config_for(flat.shape[0])
    return torch.ops.rlspec.gated_mlp(flat, weight, **config, pdl=pdl).reshape(*x.shape[:-1], weight.shape[0] // 2)
