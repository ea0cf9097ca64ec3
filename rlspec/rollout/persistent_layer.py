"""One decoder layer of a decode step at a few rows as one resident Triton kernel (`decode_layer`).

At a few rows a decode step is bound by latency, not by the weights' bytes: a layer ran eight kernels (two norms,
the q/k/v, output and down projections split over K, attention and its merge, gate/up), each 2-8 us where its
bytes alone take well under 1-5 us, and at 4 rows the step costs nearly what it costs at 64. Here a layer is one
kernel whose grid is a fixed number of programs per SM, all resident at once (a cooperative launch, which fails
rather than hangs when they do not fit). It runs the layer's phases in order; in each phase every program takes
that phase's tiles round-robin, and a grid-wide sync (an atomic counter: each program adds one, then waits for
the count of all) separates a phase from the next. The phases are the decode kernels' own per-program bodies, so
the arithmetic is theirs:

0. the residual stream plus the last layer's MLP parts (summed in order, rounded once, as
   `StaticDecoder._summed`), and the first RMS norm: one program a row;
1. the fused q/k/v projection split over K (`skinny_linear.skinny_tile`);
2. attention with RoPE and the new K/V's cache writes, adding q/k/v's parts and bias
   (`live_attention.attention_program`);
3. where a row's positions are split, the merge of the parts (`live_attention.merge_program`);
4. the output projection split over K;
5. the stream plus its parts, and the second RMS norm;
6. gate/up with silu(gate) * up (`gated_mlp.gated_tile`);
7. the down projection split over K: its fp32 parts go out as the compiled layer's MLP output does, for the
   next layer's phase 0 (or the final norm) to add.
Each split-K phase takes as many parts as keep its tiles within one round of the grid.

`phased=True` runs the same phases as one launch each, without syncs. Triton's interpreter runs programs one
after another, so no sync there is ever reached by all of them: the CPU tests check the phases that way. On a
GPU it is the measure of what the syncs save over kernel boundaries.

Needs Triton and a CUDA model (`live_attention.triton_runs_on`), fused q/k/v and gate/up weights, no output
projection bias, and at most `MAX_ROWS` rows; `StaticDecoder` uses it only then (`persistent_layers`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import gated_mlp, skinny_linear
from .live_attention import _LOG2E, _MASKED, BLOCK_N, sm_count, splits_for, triton

MAX_ROWS = 64

if triton is not None:
    import triton.language as tl

    from .gated_mlp import gated_tile
    from .live_attention import attention_program, merge_program
    from .skinny_linear import skinny_tile

    @triton.jit
    def _sync(counter_ptr, arrivals):
        """Wait until the counter reaches `arrivals` (all programs, times the syncs so far): the program's writes
        before it are seen by every program after it (a release add, an acquire read, the block's barriers)."""
        tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
        while tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < arrivals:
            pass
        tl.debug_barrier()

    @triton.jit
    def _residual_norm(x_ptr, parts_ptr, parts, s_part, w_ptr, stream_ptr, normed_ptr, row, eps,
                       HID: tl.constexpr, BLOCK_H: tl.constexpr):
        """Row `row` of the stream x + the parts' sum (fp32, in order, rounded once) to `stream_ptr`, and its RMS norm
        times the norm's weight to `normed_ptr`, as the compiled layer rounds them."""
        cols = tl.arange(0, BLOCK_H)
        mask = cols < HID
        total = tl.load(parts_ptr + row * HID + cols, mask=mask, other=0.0).to(tl.float32)
        for part in range(1, parts):
            total += tl.load(parts_ptr + part * s_part + row * HID + cols, mask=mask, other=0.0).to(tl.float32)
        dtype = stream_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * HID + cols, mask=mask, other=0.0).to(tl.float32) + total.to(dtype).to(tl.float32)
        x = x.to(dtype)
        tl.store(stream_ptr + row * HID + cols, x, mask=mask)
        xf = x.to(tl.float32)
        normed = (xf * tl.math.rsqrt(tl.sum(xf * xf, 0) / HID + eps)).to(dtype)
        weight = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(normed_ptr + row * HID + cols, (weight * normed.to(tl.float32)).to(dtype), mask=mask)

    @triton.jit
    def _decode_layer(x_ptr, delta_ptr, delta_parts, stream_ptr, normed_ptr, x_out_ptr, delta_out_ptr, norm1_ptr,
                      norm2_ptr, eps, wqkv_ptr, bqkv_ptr, qkv_ptr, k_ptr, v_ptr, valid_ptr, length_ptr, write_ptr,
                      cos_ptr, sin_ptr, att_ptr, att_part_ptr, att_stat_ptr, sk_b, sk_h, sk_s, s_valid, s_rope,
                      wo_ptr, o_ptr, wgu_ptr, y_ptr, wd_ptr, counter_ptr, M,
                      HID: tl.constexpr, QKV_N: tl.constexpr, FFN: tl.constexpr,
                      QKV_CHUNK: tl.constexpr, QKV_SPLITS: tl.constexpr, O_CHUNK: tl.constexpr,
                      O_SPLITS: tl.constexpr, DOWN_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                      SCALE_LOG2: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                      HEADS: tl.constexpr, KV_HEADS: tl.constexpr, ATT_BLOCK: tl.constexpr,
                      ATT_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, MASKED: tl.constexpr,
                      HAS_BIAS: tl.constexpr, PHASE: tl.constexpr, SYNC: tl.constexpr):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        syncs = 0
        if SYNC or PHASE == 0:
            for row in range(pid, M, programs):
                _residual_norm(x_ptr, delta_ptr, delta_parts, M * HID, norm1_ptr, stream_ptr, normed_ptr, row, eps,
                               HID, BLOCK_H)
        if SYNC:
            syncs += 1
            _sync(counter_ptr, syncs * programs)
        if SYNC or PHASE == 1:
            blocks = tl.cdiv(QKV_N, BLOCK_N)
            for tile in range(pid, blocks * QKV_SPLITS, programs):
                skinny_tile(normed_ptr, wqkv_ptr, qkv_ptr, M, QKV_N, HID, HID, HID, tile % blocks, tile // blocks, 0,
                            QKV_CHUNK, BLOCK_M, BLOCK_N, BLOCK_K)
        if SYNC:
            syncs += 1
            _sync(counter_ptr, syncs * programs)
        if SYNC or PHASE == 2:
            for task in range(pid, M * KV_HEADS * ATT_SPLITS, programs):
                attention_program(task // (KV_HEADS * ATT_SPLITS), (task // ATT_SPLITS) % KV_HEADS, task % ATT_SPLITS,
                                  qkv_ptr, k_ptr, v_ptr, valid_ptr, length_ptr, att_ptr, att_part_ptr, att_stat_ptr,
                                  cos_ptr, sin_ptr, write_ptr, bqkv_ptr, QKV_N, D, sk_b, sk_h, sk_s, sk_b, sk_h, sk_s,
                                  s_valid, s_rope, M * QKV_N, SCALE_LOG2, GROUP, BLOCK_G, D, HEADS, ATT_BLOCK,
                                  ATT_SPLITS, MASKED, True, QKV_SPLITS, HAS_BIAS)
        if ATT_SPLITS > 1:
            if SYNC:
                syncs += 1
                _sync(counter_ptr, syncs * programs)
            if SYNC or PHASE == 3:
                for head in range(pid, M * HEADS, programs):
                    merge_program(head, att_part_ptr, att_stat_ptr, att_ptr, D, ATT_SPLITS, BLOCK_S)
        if SYNC:
            syncs += 1
            _sync(counter_ptr, syncs * programs)
        if SYNC or PHASE == 4:
            blocks = tl.cdiv(HID, BLOCK_N)
            for tile in range(pid, blocks * O_SPLITS, programs):
                skinny_tile(att_ptr, wo_ptr, o_ptr, M, HID, HEADS * D, HEADS * D, HEADS * D, tile % blocks,
                            tile // blocks, 0, O_CHUNK, BLOCK_M, BLOCK_N, BLOCK_K)
        if SYNC:
            syncs += 1
            _sync(counter_ptr, syncs * programs)
        if SYNC or PHASE == 5:
            for row in range(pid, M, programs):
                _residual_norm(stream_ptr, o_ptr, O_SPLITS, M * HID, norm2_ptr, x_out_ptr, normed_ptr, row, eps, HID,
                               BLOCK_H)
        if SYNC:
            syncs += 1
            _sync(counter_ptr, syncs * programs)
        if SYNC or PHASE == 6:
            for tile in range(pid, tl.cdiv(FFN, BLOCK_N), programs):
                gated_tile(normed_ptr, wgu_ptr, y_ptr, M, FFN, HID, HID, HID, FFN, 0, tile, BLOCK_M, BLOCK_N, BLOCK_K)
        if SYNC:
            syncs += 1
            _sync(counter_ptr, syncs * programs)
        if SYNC or PHASE == 7:
            blocks = tl.cdiv(HID, BLOCK_N)
            down_splits = tl.cdiv(FFN, DOWN_CHUNK)
            for tile in range(pid, blocks * down_splits, programs):
                skinny_tile(y_ptr, wd_ptr, delta_out_ptr, M, HID, FFN, FFN, FFN, tile % blocks, tile // blocks, 0,
                            DOWN_CHUNK, BLOCK_M, BLOCK_N, BLOCK_K)
        if SYNC:  # the last program out sets the counter back to zero for the next launch
            if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == (syncs + 1) * programs - 1:
                tl.atomic_xchg(counter_ptr, 0, sem="release", scope="gpu")


def _splits(n: int, k: int, block_n: int, block_k: int, programs: int) -> tuple[int, int]:
    """(K columns a part, parts) of a split-K phase: as many parts as keep its tiles within one round of the grid."""
    return skinny_linear.chunking(k, max(1, min(programs // -(-n // block_n), k // block_k)), block_k)


def decode_layer(x: Tensor, delta: Tensor, norm1: Tensor, wqkv: Tensor, bqkv: Tensor | None, keys: Tensor,
                 values: Tensor, valid: Tensor, lengths: Tensor, write: Tensor, cos: Tensor, sin: Tensor,
                 wo: Tensor, norm2: Tensor, w_gate_up: Tensor, w_down: Tensor, eps: float, scale: float, heads: int,
                 counter: Tensor, programs_per_sm: int = 2, phased: bool = False) -> tuple[Tensor, Tensor]:
    """A decode step's decoder layer: the stream `x` [M, H] (model dtype) plus the last layer's MLP output `delta`
    [P, M, H] (parts, as `StaticDecoder._layer` takes them), through attention and the MLP. Returns the stream after
    attention [M, H] and this layer's MLP output as fp32 parts [P', M, H] (the compiled layer's pair).

    wqkv [(heads + 2 Hkv) D, H] and bqkv (or None): the fused q/k/v projection; caches [B >= M, Hkv, S, D] with
    valid [B, S] uint8, lengths [B] and write [B] as `live_attention.live_attention_rope` takes them; cos and sin
    [M, D]; wo [H, heads D] (no bias); w_gate_up [2F, H] fused; w_down [H, F]. `counter`: one int32 on the device,
    zero between launches (each launch sets it back). `phased`: one launch a phase, no syncs (see the module)."""
    rows, hidden = x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"decode_layer takes at most {MAX_ROWS} rows, got {rows}")
    for name, t in (("x", x), ("delta", delta), ("keys", keys), ("values", values)):
        if not t.is_contiguous():
            raise ValueError(f"decode_layer needs a contiguous {name}")
    device = x.device
    kv_heads, dim = keys.shape[1], keys.shape[3]
    qkv_n, ffn = wqkv.shape[0], w_down.shape[1]
    sms = sm_count(device.index or 0) if device.type == "cuda" else 132
    programs = sms * programs_per_sm
    block_m, block_n, block_k = (16 if rows <= 16 else 64), 32, 128
    qkv_chunk, qkv_splits = _splits(qkv_n, hidden, block_n, block_k, programs)
    o_chunk, o_splits = _splits(hidden, heads * dim, block_n, block_k, programs)
    down_chunk, down_splits = _splits(hidden, ffn, block_n, block_k, programs)
    att_splits = splits_for(rows, kv_heads, keys.shape[2], programs // 2)
    f32 = dict(dtype=torch.float32, device=device)
    stream = torch.empty_like(x)
    normed = torch.empty_like(x)
    x_out = torch.empty_like(x)
    qkv = torch.empty(qkv_splits, rows, qkv_n, **f32)
    att = torch.empty(rows, heads * dim, dtype=x.dtype, device=device)
    att_part = torch.empty(rows * heads * att_splits * dim if att_splits > 1 else 1, **f32)
    att_stat = torch.empty(rows * heads * att_splits * 2 if att_splits > 1 else 1, **f32)
    o = torch.empty(o_splits, rows, hidden, **f32)
    y = torch.empty(rows, ffn, dtype=x.dtype, device=device)
    delta_out = torch.empty(down_splits, rows, hidden, **f32)
    group = heads // kv_heads
    args = (x, delta, delta.shape[0], stream, normed, x_out, delta_out, norm1, norm2, eps, wqkv,
            wqkv if bqkv is None else bqkv, qkv, keys, values, valid, lengths, write, cos, sin, att, att_part,
            att_stat, keys.stride(0), keys.stride(1), keys.stride(2), valid.stride(0), cos.stride(0), wo, o,
            w_gate_up, y, w_down, counter, rows)
    constants = dict(HID=hidden, QKV_N=qkv_n, FFN=ffn, QKV_CHUNK=qkv_chunk, QKV_SPLITS=qkv_splits, O_CHUNK=o_chunk,
                     O_SPLITS=o_splits, DOWN_CHUNK=down_chunk, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                     BLOCK_H=triton.next_power_of_2(hidden), SCALE_LOG2=scale * _LOG2E, GROUP=group,
                     BLOCK_G=max(16, triton.next_power_of_2(group)), D=dim, HEADS=heads, KV_HEADS=kv_heads,
                     ATT_BLOCK=BLOCK_N, ATT_SPLITS=att_splits, BLOCK_S=triton.next_power_of_2(att_splits),
                     MASKED=_MASKED, HAS_BIAS=bqkv is not None, num_warps=4, num_stages=3)
    if phased:
        for phase in range(8):
            if phase == 3 and att_splits == 1:
                continue
            _decode_layer[(programs,)](*args, PHASE=phase, SYNC=False, **constants)
    else:
        _decode_layer[(programs,)](*args, PHASE=-1, SYNC=True, launch_cooperative_grid=True, **constants)
    return x_out, delta_out
