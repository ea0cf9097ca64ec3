"""The train step's log-prob head, its reductions over the logits as two Triton kernels that each read a chunk's
16-bit logits once: the forward's statistics (`head_stats`) and the backward's logits gradient, written over the
logits in place (`head_logits_grad_`).

The compiled reductions they replace (`rlspec.core.grpo._head_stats`, `_head_grad`, still used without Triton)
read the logits about twice in forward (the maximum, then the exponentials) and write a new gradient tensor in
backward. At one chunk of the 0.5B shape (883 x 151,936 bf16, one H100, `python -m rlspec.perf.bench_head`):
the forward's reduction 0.17 ms against 0.39, a copy of the same logits taking 0.19 ms; the gradient 0.27 ms
against 0.26-0.30 (the compiled one already ran at about copy speed: here it saves the second buffer only).

- forward: one program per (row, part of the vocabulary) walks its part in blocks with an online softmax in
  base 2 (a running max m, sum 2^(y - m) and sum 2^(y - m) y for y = z log2(e), z = logits / T) and stores
  the three; a second kernel, one program per row, combines the parts into the log-sum-exp, log p(target) =
  z_t - lse and the entropy lse - sum_j p_j z_j;
- backward: d loss / d logits = g (onehot(t) - e^(z - lse)) / T, in the logits' dtype, over the logits.

Gathering the head's weight, the GEMMs and the chunking stay with the caller (`rlspec.core.grpo._ChunkedLogprobs`).
A GEMM with these reductions in its epilogue, so that the logits are never written, was tried first: at that
chunk its Triton GEMM took 0.65-0.96 ms for the logits over a sweep of seven tile shapes, against cuBLAS's
0.38 ms: more than the passes it saved.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None

BLOCK = 4096
"""Columns a program reads per step of its walk over the vocabulary."""
_LOG2E = 1.4426950408889634


def available(logits: Tensor) -> bool:
    """Whether the kernels take these logits: 16-bit, on CUDA, with Triton installed."""
    return triton is not None and logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16)


if triton is not None:
    @triton.jit
    def _stats_kernel(x_ptr, max_ptr, sum_ptr, ysum_ptr, V, s_xm, span, scale_log2, parts, BLOCK: tl.constexpr):
        row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
        lo = part * span
        hi = tl.minimum(lo + span, V)
        offs = tl.arange(0, BLOCK)
        top = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        weighted = tl.zeros([], tl.float32)
        for start in range(lo, hi, BLOCK):
            cols = start + offs
            inside = cols < hi
            y = tl.load(x_ptr + row * s_xm + cols, mask=inside, other=float("-inf")).to(tl.float32) * scale_log2
            new = tl.maximum(top, tl.max(y, 0))
            e = tl.exp2(y - new)
            rescale = tl.exp2(top - new)
            total = total * rescale + tl.sum(e, 0)
            weighted = weighted * rescale + tl.sum(e * tl.where(inside, y, 0.0), 0)
            top = new
        at = row * parts + part
        tl.store(max_ptr + at, top)
        tl.store(sum_ptr + at, total)
        tl.store(ysum_ptr + at, weighted)

    @triton.jit
    def _combine_kernel(max_ptr, sum_ptr, ysum_ptr, x_ptr, t_ptr, picked_ptr, entropy_ptr, lse_ptr, s_xm, inv_t,
                        parts, BLOCK_P: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_P)
        inside = offs < parts
        part_max = tl.load(max_ptr + row * parts + offs, mask=inside, other=float("-inf"))
        top = tl.max(part_max, 0)
        scale = tl.exp2(part_max - top)
        total = tl.sum(tl.load(sum_ptr + row * parts + offs, mask=inside, other=0.0) * scale, 0)
        weighted = tl.sum(tl.load(ysum_ptr + row * parts + offs, mask=inside, other=0.0) * scale, 0)
        ln2 = 0.6931471805599453
        lse = (top + tl.log2(total)) * ln2
        target = tl.load(t_ptr + row)
        picked = tl.load(x_ptr + row * s_xm + target).to(tl.float32) * inv_t
        tl.store(picked_ptr + row, picked - lse)
        tl.store(entropy_ptr + row, lse - weighted / total * ln2)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _grad_kernel(x_ptr, t_ptr, lse_ptr, g_ptr, V, s_xm, span, scale_log2, inv_t, BLOCK: tl.constexpr):
        row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
        lo = part * span
        hi = tl.minimum(lo + span, V)
        offs = tl.arange(0, BLOCK)
        lse_log2 = tl.load(lse_ptr + row) * 1.4426950408889634  # log2(e), as _LOG2E
        scale = tl.load(g_ptr + row) * inv_t
        target = tl.load(t_ptr + row)
        for start in range(lo, hi, BLOCK):
            cols = start + offs
            inside = cols < hi
            y = tl.load(x_ptr + row * s_xm + cols, mask=inside, other=0.0).to(tl.float32) * scale_log2
            grad = (tl.where(cols == target, 1.0, 0.0) - tl.exp2(y - lse_log2)) * scale
            tl.store(x_ptr + row * s_xm + cols, grad.to(x_ptr.dtype.element_ty), mask=inside)


def _parts(rows: int, vocab: int, device: torch.device, block: int) -> tuple[int, int]:
    """(parts, span): each row's vocabulary cut into parts of whole blocks, enough that the (row, part) programs
    number about eight per SM (an H100's 132 under Triton's interpreter), none shorter than two blocks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    blocks = triton.cdiv(vocab, block)
    parts = max(1, min(triton.cdiv(8 * sms, rows), blocks // 2))
    span = triton.cdiv(blocks, parts) * block
    return triton.cdiv(vocab, span), span


def head_stats(logits: Tensor, targets: Tensor, temperature: float,
               block: int = BLOCK) -> tuple[Tensor, Tensor, Tensor]:
    """log p(target), the entropy and the log-sum-exp (fp32, [M] each) of z = logits / T for logits [M, V]
    (rows contiguous) and targets [M] (module docstring)."""
    rows, vocab = logits.shape
    parts, span = _parts(rows, vocab, logits.device, block)
    part_max, part_sum, part_ysum = (torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
                                     for _ in range(3))
    _stats_kernel[(rows, parts)](logits, part_max, part_sum, part_ysum, vocab, logits.stride(0), span,
                                 _LOG2E / temperature, parts, BLOCK=block, num_warps=8)
    picked, entropy, lse = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    _combine_kernel[(rows,)](part_max, part_sum, part_ysum, logits, targets.contiguous(), picked, entropy, lse,
                             logits.stride(0), 1.0 / temperature, parts,
                             BLOCK_P=max(16, triton.next_power_of_2(parts)), num_warps=1)
    return picked, entropy, lse


def head_logits_grad_(logits: Tensor, targets: Tensor, lse: Tensor, grad_picked: Tensor, temperature: float,
                      block: int = BLOCK) -> Tensor:
    """d loss / d logits for upstream `grad_picked` [M] on log p(target), from `head_stats`'s `lse`, written
    over `logits` [M, V] (rows contiguous), which it returns."""
    rows, vocab = logits.shape
    parts, span = _parts(rows, vocab, logits.device, block)
    _grad_kernel[(rows, parts)](logits, targets.contiguous(), lse.contiguous(), grad_picked.float().contiguous(),
                                vocab, logits.stride(0), span, _LOG2E / temperature, 1.0 / temperature,
                                BLOCK=block, num_warps=8)
    return logits
