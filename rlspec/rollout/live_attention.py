"""Attention of one new token per row over the slot-indexed KV cache, reading only each row's live positions.

The CUDA-graph sampler's cache has a fixed length per graph (the prompt width plus `max_new_tokens`, rounded
up), and `scaled_dot_product_attention` reads all of it every decode step, masked; early in a batch, and for
every short sample of a long-tailed one, most of that read is of positions no token has reached. Here a row
reads only positions below its `length` (its next cache slot + 1): a loop with a bound read from device memory,
so one captured graph serves every step.

Flash-decoding: each (row, K/V head) program scores the `GROUP` query heads that share that K/V head against
blocks of `BLOCK_N` positions with an online softmax (fp32 scores and sums, base 2); the row's positions are cut
into `splits` parts run as separate programs when rows x K/V heads alone would leave SMs idle, and a second
kernel merges the parts' (max, sum, weighted values). Positions not `valid` (left padding of the prompt) score
a large negative number, not -inf, so an empty slot (nothing valid) stays finite, as with SDPA's mask.

`live_attention_rope` is the same kernel for a decode step that has not yet rotated or cached its new token: it
takes the q/k/v projection's output (or that projection's split-K parts and bias, which it sums), applies RoPE to
q and the new k, and the program whose part of the cache holds the new position writes the new K/V there before
its loop reads them; the compiled layer ran those as two element-wise kernels before the attention op.

Needs Triton and a power-of-two head dim; `available` says whether this process can use it. The decode step
falls back to SDPA otherwise (`StaticDecoder.attention_mask`).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

BLOCK_N = 128
_MASKED = -1.0e30  # a masked score: exp2(_MASKED - m) is 0 for any real m, and finite when every score is masked
_LOG2E = 1.4426950408889634


def triton_runs_on(device: torch.device) -> bool:
    """Whether this process can run the decode step's Triton kernels on `device`: CUDA, with Triton installed (the
    kernel modules' `available`)."""
    return triton is not None and torch.device(device).type == "cuda"


def available(head_dim: int, device: torch.device) -> bool:
    return triton_runs_on(device) and head_dim >= 16 and head_dim & (head_dim - 1) == 0


_SMS: dict[int, int] = {}


def sm_count(index: int) -> int:
    """The device's SM count (a dict, not `lru_cache`: Dynamo traces through this inside compiled layers)."""
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def splits_for(rows: int, kv_heads: int, cache_len: int, sms: int) -> int:
    """Parts per row: one while (row, K/V head) programs fill half the SMs (the merge kernel costs more than the
    split gains then), else enough parts for two programs per SM, none shorter than a block."""
    programs = rows * kv_heads
    if 2 * programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), cache_len // BLOCK_N))


if triton is not None:
    @triton.jit
    def _projected(row_ptr, bias_ptr, cols, mask, s_part, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   dtype: tl.constexpr):
        """Columns `cols` of a row of the q/k/v projection in fp32, as the model dtype holds them: read as they are
        (PARTS = 0), or summed from `PARTS` split-K fp32 parts `s_part` apart (the bias added to the first, in
        order, as `StaticDecoder._summed` adds them) and rounded to `dtype`."""
        if PARTS == 0:
            return tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        total = tl.load(row_ptr + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            total += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        for part in tl.static_range(1, PARTS):
            total += tl.load(row_ptr + part * s_part + cols, mask=mask, other=0.0)
        return total.to(dtype).to(tl.float32)

    @triton.jit
    def _rotated(row_ptr, bias_ptr, first, d, D: tl.constexpr, cos, sin, mask, s_part, PARTS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, dtype: tl.constexpr):
        """RoPE of the projection's vectors at columns `first` + d (d in [0, D)): x * cos + rotate_half(x) * sin in
        fp32, rotate_half(x) = cat(-x[D/2:], x[:D/2]), rounded once to `dtype` (as the compiled layer rotated)."""
        x = _projected(row_ptr, bias_ptr, first + d, mask, s_part, PARTS, HAS_BIAS, dtype)
        partner = _projected(row_ptr, bias_ptr, first + (d + D // 2) % D, mask, s_part, PARTS, HAS_BIAS, dtype)
        return (x * cos + tl.where(d < D // 2, -partner, partner) * sin).to(dtype)

    @triton.jit
    def _live_attention_parts(q_ptr, k_ptr, v_ptr, valid_ptr, length_ptr, out_ptr, part_ptr, stat_ptr,
                              cos_ptr, sin_ptr, write_ptr, bias_ptr, sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                              s_valid, s_rope, s_part, SCALE_LOG2: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK_G: tl.constexpr, D: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr,
                              SPLITS: tl.constexpr, MASKED: tl.constexpr, ROPE: tl.constexpr,
                              QKV_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr):
        b = tl.program_id(0)
        kv = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        offsets = tl.arange(0, BLOCK)
        heads = kv * GROUP + g
        in_group = g < GROUP
        length = tl.load(length_ptr + b).to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK) * BLOCK
        lo = split * chunk
        hi = tl.minimum(lo + chunk, length)
        k_row = k_ptr + b * sk_b + kv * sk_h
        v_row = v_ptr + b * sv_b + kv * sv_h
        if ROPE:  # q_ptr: the q/k/v projection, q heads then k then v, D columns each; not yet rotated
            dtype = k_ptr.dtype.element_ty
            row = q_ptr + b * sq_b
            cos = tl.load(cos_ptr + b * s_rope + d).to(tl.float32)
            sin = tl.load(sin_ptr + b * s_rope + d).to(tl.float32)
            q = _rotated(row, bias_ptr, heads[:, None] * D, d[None, :], D, cos[None, :], sin[None, :],
                         in_group[:, None], s_part, QKV_PARTS, HAS_BIAS, dtype)
            # the new token's K/V into the cache, by the one program whose part holds its position, before that
            # program's loop reads it (the barrier: the block's writes are seen by all its threads)
            write = tl.load(write_ptr + b).to(tl.int32)
            owner = split == tl.minimum(write // tl.maximum(chunk, BLOCK), SPLITS - 1)
            key = _rotated(row, bias_ptr, (H + kv) * D, d, D, cos, sin, d < D, s_part, QKV_PARTS, HAS_BIAS, dtype)
            value = _projected(row, bias_ptr, (H + H // GROUP + kv) * D + d, d < D, s_part, QKV_PARTS, HAS_BIAS,
                               dtype).to(dtype)
            tl.store(k_row + write * sk_s + d, key, mask=(d < D) & owner)
            tl.store(v_row + write * sv_s + d, value, mask=(d < D) & owner)
            tl.debug_barrier()
        else:
            q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=in_group[:, None], other=0.0)
        m = tl.full([BLOCK_G], MASKED, tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for start in range(lo, hi, BLOCK):
            pos = start + offsets
            inside = pos < hi
            ok = tl.load(valid_ptr + b * s_valid + pos, mask=inside, other=0) != 0
            k = tl.load(k_row + pos[:, None] * sk_s + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_row + pos[:, None] * sv_s + d[None, :], mask=inside[:, None], other=0.0)  # in flight with k
            scores = tl.dot(q, tl.trans(k)) * SCALE_LOG2
            scores = tl.where(ok[None, :], scores, MASKED)
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if SPLITS == 1:
            out = acc / total[:, None]
            tl.store(out_ptr + (b * H + heads[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=in_group[:, None])
        else:
            row = (b * H + heads) * SPLITS + split
            tl.store(part_ptr + row[:, None] * D + d[None, :], acc, mask=in_group[:, None])
            tl.store(stat_ptr + row * 2, m, mask=in_group)
            tl.store(stat_ptr + row * 2 + 1, total, mask=in_group)

    @triton.jit
    def _live_attention_merge(part_ptr, stat_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr,
                              BLOCK_S: tl.constexpr):
        head = tl.program_id(0)  # b * H + h
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, D)
        used = s < SPLITS
        m = tl.load(stat_ptr + (head * SPLITS + s) * 2, mask=used, other=float("-inf"))
        total = tl.load(stat_ptr + (head * SPLITS + s) * 2 + 1, mask=used, other=0.0)
        acc = tl.load(part_ptr + (head * SPLITS + s[:, None]) * D + d[None, :], mask=used[:, None], other=0.0)
        weight = tl.exp2(m - tl.max(m, 0))
        out = tl.sum(acc * weight[:, None], 0) / tl.sum(total * weight, 0)
        tl.store(out_ptr + head * D + d, out.to(out_ptr.dtype.element_ty))


def _launch(launch, q: Tensor, keys: Tensor, values: Tensor, valid: Tensor, lengths: Tensor, scale: float,
            splits: int, block: int = BLOCK_N, warps: int = 4, stages: int = 2,
            rope: tuple[Tensor, Tensor, Tensor] | None = None, heads: int = 0, bias: Tensor | None = None) -> Tensor:
    """The kernels' launches (`launch`: identity, or torch's `wrap_triton` inside the custom op). `rope`: q is the
    q/k/v projection, [B, (heads + 2 Hkv) D] in the model dtype or its split-K parts [P, B, (heads + 2 Hkv) D] in
    fp32 (with the projection's `bias`, if any), and (cos, sin, write) rotate it and place the new K/V (see
    `live_attention_rope`); else q is [B, H, 1, D]."""
    kv_heads, dim = keys.shape[1], keys.shape[3]
    parts, s_part, s_rope = 0, 0, 0
    if rope is None:
        rows, heads = q.shape[0], q.shape[1]
        q_strides = (q.stride(0), q.stride(1))
        cos = sin = write = q  # not read
    else:
        cos, sin, write = rope
        s_rope = cos.stride(0)
        if q.dim() == 3:
            parts, s_part = q.shape[0], q.stride(0)
        rows = q.shape[-2]
        q_strides = (q.stride(-2), dim)
    group = heads // kv_heads
    out = torch.empty(rows, 1, heads, dim, dtype=keys.dtype, device=q.device)
    part = torch.empty(rows * heads * splits * dim if splits > 1 else 1, dtype=torch.float32, device=q.device)
    stat = torch.empty(rows * heads * splits * 2 if splits > 1 else 1, dtype=torch.float32, device=q.device)
    launch(_live_attention_parts)[(rows, kv_heads, splits)](
        q, keys, values, valid, lengths, out, part, stat, cos, sin, write, q if bias is None else bias, *q_strides,
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        valid.stride(0), s_rope, s_part, SCALE_LOG2=scale * _LOG2E, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), D=dim, H=heads, BLOCK=block, SPLITS=splits, MASKED=_MASKED,
        ROPE=rope is not None, QKV_PARTS=parts, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages)
    if splits > 1:
        launch(_live_attention_merge)[(rows * heads,)](part, stat, out, D=dim, SPLITS=splits,
                                                       BLOCK_S=triton.next_power_of_2(splits))
    return out


def live_attention_eager(q: Tensor, keys: Tensor, values: Tensor, valid: Tensor, lengths: Tensor, scale: float,
                         splits: int, **config) -> Tensor:
    """The kernels launched directly (tests under Triton's interpreter, kernel timings): [B, 1, H, D]."""
    return _launch(lambda kernel: kernel, q, keys, values, valid, lengths, scale, splits, **config)


if triton is not None:
    @torch.library.triton_op("rlspec::live_attention", mutates_args=())
    def _live_attention_op(q: Tensor, keys: Tensor, values: Tensor, valid: Tensor, lengths: Tensor, scale: float,
                           splits: int) -> Tensor:
        from torch.library import wrap_triton
        return _launch(wrap_triton, q, keys, values, valid, lengths, scale, splits)

    @torch.library.triton_op("rlspec::live_attention_rope", mutates_args=("keys", "values"))
    def _live_attention_rope_op(qkv: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, keys: Tensor,
                                values: Tensor, valid: Tensor, lengths: Tensor, write: Tensor, scale: float, heads: int,
                                splits: int) -> Tensor:
        from torch.library import wrap_triton
        return _launch(wrap_triton, qkv, keys, values, valid, lengths, scale, splits, rope=(cos, sin, write),
                       heads=heads, bias=bias)


def live_attention(q: Tensor, keys: Tensor, values: Tensor, valid: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """q [B, H, 1, D] (any strides with D contiguous) against caches [B, Hkv, S, D]; `valid` [B, S] uint8 (1: a
    real token), `lengths` [B] (positions >= length are not read). Returns [B, H, 1, D] (a transposed view of a
    contiguous [B, 1, H, D], so the output projection's reshape copies nothing)."""
    splits = splits_for(q.shape[0], keys.shape[1], keys.shape[2], sm_count(q.device.index or 0))
    return torch.ops.rlspec.live_attention(q, keys, values, valid, lengths, scale, splits).transpose(1, 2)


def live_attention_rope(qkv: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
                        valid: Tensor, lengths: Tensor, write: Tensor, scale: float, heads: int) -> Tensor:
    """A decode step's attention from its q/k/v projection, in one kernel: `live_attention` of q rotated by RoPE,
    after the new token's rotated k and its v are written into the caches at position `write` (in place).

    qkv: the projection's output [B, (heads + 2 Hkv) D] (D contiguous; q heads, then k, then v), its `bias` already
    added (pass None); or its split-K parts [P, B, (heads + 2 Hkv) D] in fp32 (`skinny_linear` without the bias),
    summed here with `bias` and rounded to the model dtype as the decoder sums parts. cos and sin [B, D] (the row's
    RoPE, attention scaling included), caches [B, Hkv, S, D], valid [B, S] uint8, lengths [B] and write [B] (the
    new token's cache position; attended where write < lengths). The rotations follow the compiled layer's (fp32,
    one rounding to the cache dtype). Returns [B, heads, 1, D] as `live_attention`."""
    rows = qkv.shape[-2]
    splits = splits_for(rows, keys.shape[1], keys.shape[2], sm_count(qkv.device.index or 0))
    return torch.ops.rlspec.live_attention_rope(qkv, bias, cos, sin, keys, values, valid, lengths, write, scale,
                                                heads, splits).transpose(1, 2)
