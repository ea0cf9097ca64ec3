"""The decode step's LM head and its exponential race in one Triton kernel pass over the head's weight: the
[rows, V] logits are never written.

For the final-normed hidden x [M, H] and the head's weight W [V, H] (model dtype), at temperature T, with row
i's noise keyed by (`keys[i]`, `steps[i]`) as `noise.keyed_exponential` keys it (E_ij = -log u_ij):

    z_ij = round(x_i . W_j) / T                      (round: the fp32 dot product rounded to W's dtype)
    token_i = argmax_j (z_ij - log E_ij)             (the first maximum)
    logp_i = z_i,token - log sum_j exp(z_ij)

which is `sampling.exponential_race` on `F.linear(x, W)`'s logits (its docstring says why the race samples
softmax(z)). Rounding to W's dtype first makes z the trainer's head output up to the GEMM's accumulation
order, so the engine's log-probs stay the trainer's; scores and log-sum-exp are fp32.

Why: at decode sizes the head GEMM is bound by reading W (the 0.5B shape's tied head is 272 MB of bf16, ~81 us
of an H100's HBM bandwidth at any row count up to a few hundred) and leaves the ALUs idle, while the race over
its logits is a second kernel bound by the noise's integer hashing (at 64 rows: 107 us and 78 us of a 1.21 ms
step). Here the hashing and the reductions run on each tile of logits while it is still in registers, beside
other programs' weight reads.

- `_head_race_tiles`: one program per (row block, vocabulary tile), the row blocks of one tile next to each other
  in launch order so that its weights come from HBM once and from L2 after. The K loop accumulates the tile's
  logits in fp32; the program then stores, per (row, tile): the best score and its column (first maximum), z at
  that column, and the tile's max of z and sum of exp(z - max).
- `_combine_tiles`: one program per row. The first tile holding the row's best score gives the token (so it is
  the whole row's first argmax, as in `exponential_race`) and its z; logp = (z - top) - log sum_t s_t exp(m_t -
  top) over the tiles' (m_t, s_t), top = max_t m_t (z - lse without forming lse, which at large |z| would round).

The noise is hashed in the kernel from `keys` and `steps` with `noise._mix32_int32`'s arithmetic (int32
products wrap; right shifts are masked to logical ones), so u_ij is bit for bit `noise.keyed_uniform`; z is
scaled by 1/T, and on CUDA the outer log of log(-log u) comes from the hardware's approximate base-2 logarithm
(`_ln`), so a score may differ from the compiled race's in its last bits (a near tie may go the other way).
Deterministic: no atomics. Wrapped as the custom op `rlspec::sampled_head`, so it runs inside torch.compile and
CUDA graph captures.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .live_attention import triton
from .live_attention import triton_runs_on as available  # whether this kernel runs on a device (callers ask here)


def config_for(rows: int) -> dict:
    """Tiles of 16, 32 or 64 rows by 128 vocabulary columns, 64-deep K blocks. At 64 rows on an H200, eight other
    tiles (`bench_decode_kernels.HEAD_SWEEP`) were none more than 2 us faster, timed on a version of the kernel with
    both noise logs approximate (since taken out); not swept at other row counts.
    `python -m rlspec.perf.bench_decode_kernels --head` times it beside `F.linear` and the compiled race."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    return {"block_m": block_m, "block_n": 128, "block_k": 64, "warps": 4 if block_m < 64 else 8, "stages": 3}


if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _ln(x, FAST: tl.constexpr):
        """ln x; `FAST` (CUDA): from the hardware's approximate base-2 logarithm (one special-function instruction,
        absolute error about 2^-22), where `tl.log` is libdevice's routine of a few dozen instructions. Only for
        values whose small absolute error does not matter (the race's log E, E = -log u, not -log u itself)."""
        if FAST:
            return libdevice.fast_log2f(x) * 0.6931471805599453
        else:
            return tl.log(x)

    @triton.jit
    def _mix32(x):
        """`noise._mix32_int32` on int32 values: the products wrap modulo 2^32, each shift masked to a logical one."""
        x = x ^ ((x >> 16) & 0xFFFF)
        x = x * 0x7FEB352D
        x = x ^ ((x >> 15) & 0x1FFFF)
        x = x * 0x5BD1E995
        x = x ^ ((x >> 16) & 0xFFFF)
        x = x * 0x27D4EB2F
        return x ^ ((x >> 15) & 0x1FFFF)

    @triton.jit
    def _keyed_uniform(keys, steps, cols):
        """`noise.keyed_uniform` [rows, cols] for int64 `keys` and `steps` [rows] and int32 token ids `cols`: the
        low 32 bits of both (keys < 2^32; steps masked to 32 bits there too) hashed in int32, which gives the
        int64 hash's bits."""
        row = _mix32(keys.to(tl.int32) ^ _mix32(steps.to(tl.int32)))
        salt = _mix32(row ^ 0x45D9F3B)
        x = _mix32(_mix32(cols[None, :] ^ row[:, None]) ^ salt[:, None])
        return (((x >> 9) & 0x7FFFFF).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23, as open_uniform

    @triton.jit
    def _head_race_tiles(x_ptr, w_ptr, keys_ptr, steps_ptr, best_ptr, column_ptr, picked_ptr, max_ptr, sum_ptr,
                         M, V, sx_m, sw_n, inv_temperature, K: tl.constexpr, TILES: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                         FAST: tl.constexpr):
        m_block = tl.program_id(0)  # fastest in launch order: a tile's row blocks run together
        tile = tl.program_id(1)
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offsets = tl.arange(0, BLOCK_N)
        cols = tile * BLOCK_N + offsets
        ks = tl.arange(0, BLOCK_K)
        in_rows = rows < M
        in_cols = cols < V
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * sw_n  # V x H may pass 2^31 elements
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + ks
            x = tl.load(x_ptr + rows[:, None] * sx_m + k[None, :], mask=in_rows[:, None] & (k[None, :] < K), other=0.0)
            w = tl.load(w_rows + k[None, :], mask=in_cols[:, None] & (k[None, :] < K), other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        z = acc.to(w_ptr.dtype.element_ty).to(tl.float32) * inv_temperature  # F.linear's rounding, then / T
        z = tl.where(in_cols[None, :], z, float("-inf"))
        keys = tl.load(keys_ptr + rows, mask=in_rows, other=0)
        steps = tl.load(steps_ptr + rows, mask=in_rows, other=0)
        # z - log E, E = -log u (keyed_exponential). E keeps the exact log: an approximate one's absolute error
        # (~2^-22) is all of E where u is near 1, and the outer log would turn it into a winning score.
        score = z - _ln(-tl.log(_keyed_uniform(keys, steps, cols)), FAST)
        best, column = tl.max(score, 1, return_indices=True, return_indices_tie_break_left=True)
        picked = tl.max(tl.where(offsets[None, :] == column[:, None], z, float("-inf")), 1)
        top = tl.max(z, 1)
        total = tl.sum(tl.exp(z - top[:, None]), 1)
        at = rows * TILES + tile
        tl.store(best_ptr + at, best, mask=in_rows)
        tl.store(column_ptr + at, tile * BLOCK_N + column, mask=in_rows)
        tl.store(picked_ptr + at, picked, mask=in_rows)
        tl.store(max_ptr + at, top, mask=in_rows)
        tl.store(sum_ptr + at, total, mask=in_rows)

    @triton.jit
    def _combine_tiles(best_ptr, column_ptr, picked_ptr, max_ptr, sum_ptr, token_ptr, logp_ptr, TILES: tl.constexpr,
                       BLOCK_T: tl.constexpr):
        row = tl.program_id(0)
        offsets = tl.arange(0, BLOCK_T)
        inside = offsets < TILES
        at = row * TILES + offsets
        best = tl.load(best_ptr + at, mask=inside, other=float("-inf"))
        _, tile = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
        token = tl.load(column_ptr + row * TILES + tile)
        picked = tl.load(picked_ptr + row * TILES + tile)
        part_max = tl.load(max_ptr + at, mask=inside, other=float("-inf"))
        top = tl.max(part_max, 0)
        total = tl.sum(tl.load(sum_ptr + at, mask=inside, other=0.0) * tl.exp(part_max - top), 0)
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(logp_ptr + row, (picked - top) - tl.log(total))  # z - lse, no round trip through |top|


def _launch(launch, x: Tensor, weight: Tensor, keys: Tensor, steps: Tensor, temperature: float, block_m: int,
            block_n: int, block_k: int, warps: int = 4, stages: int = 3) -> tuple[Tensor, Tensor]:
    """The two kernels' launches (`launch`: identity, or torch's `wrap_triton` inside the custom op)."""
    rows, hidden = x.shape
    vocab = weight.shape[0]
    tiles = triton.cdiv(vocab, block_n)
    best, picked, part_max, part_sum = (torch.empty(rows, tiles, dtype=torch.float32, device=x.device)
                                        for _ in range(4))
    column = torch.empty(rows, tiles, dtype=torch.int32, device=x.device)
    launch(_head_race_tiles)[(triton.cdiv(rows, block_m), tiles)](
        x, weight, keys, steps, best, column, picked, part_max, part_sum, rows, vocab, x.stride(0), weight.stride(0),
        1.0 / temperature, K=hidden, TILES=tiles, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 weights: no TF32 rounding of the inputs
        FAST=x.is_cuda, num_warps=warps, num_stages=stages)
    token = torch.empty(rows, dtype=torch.int64, device=x.device)
    logp = torch.empty(rows, dtype=torch.float32, device=x.device)
    launch(_combine_tiles)[(rows,)](best, column, picked, part_max, part_sum, token, logp, TILES=tiles,
                                    BLOCK_T=max(16, triton.next_power_of_2(tiles)), num_warps=4)
    return token, logp


def sampled_head_eager(x: Tensor, weight: Tensor, keys: Tensor, steps: Tensor, temperature: float,
                       **config) -> tuple[Tensor, Tensor]:
    """The kernels launched directly (tests under Triton's interpreter, kernel timings)."""
    return _launch(lambda kernel: kernel, x, weight, keys, steps, temperature, **config)


if triton is not None:
    @torch.library.triton_op("rlspec::sampled_head", mutates_args=())
    def _sampled_head_op(x: Tensor, weight: Tensor, keys: Tensor, steps: Tensor, temperature: float, block_m: int,
                         block_n: int, block_k: int, warps: int, stages: int) -> tuple[Tensor, Tensor]:
        from torch.library import wrap_triton
        return _launch(wrap_triton, x, weight, keys, steps, temperature, block_m, block_n, block_k, warps, stages)


def sampled_head(hidden: Tensor, weight: Tensor, keys: Tensor, steps: Tensor,
                 temperature: float) -> tuple[Tensor, Tensor]:
    """The sampled token [M] (int64) and its log-probability [M] (fp32) for the final-normed `hidden` [M, H] and
    the head's `weight` [V, H] (the same dtype, H contiguous), row i's noise keyed by (`keys[i]`, `steps[i]`)
    (int64 [M]); the module docstring gives the math."""
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    return torch.ops.rlspec.sampled_head(hidden, weight, keys.contiguous(), steps.contiguous(), temperature,
                                         **config_for(hidden.shape[0]))
