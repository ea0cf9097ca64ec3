"""The Triton log-prob head kernels (`rlspec.core.fused_head`) against the compiled chunk's math they replace
(`_head_stats`, `_head_grad`). On CPU under Triton's interpreter in fp32 where Triton is installed (CPU-only torch
ships without it, so CI skips that case); on CUDA in bf16, where the train path takes them by default
(`tests/test_policy.py::test_fused_head_on_cuda_bf16_matches_the_plain_head` checks the whole head)."""

from __future__ import annotations

import pytest
import torch

from rlspec.core.grpo import _head_grad, _head_stats
from tests.triton_interpreter import allow_scalar_loop_bounds, run_interpreted


def _check(dtype, device, rows, vocab, block, atol):
    from rlspec.core.fused_head import head_logits_grad_, head_stats

    torch.manual_seed(0)
    logits = (torch.randn(rows, vocab, device=device) * 4).to(dtype)  # peaked rows: the parts' maxima differ
    targets = torch.randint(0, vocab, (rows,), device=device)
    targets[:3] = torch.tensor([0, vocab - 1, block])  # the first and last column, a block's first
    upstream = torch.randn(rows, device=device)
    for temperature in (1.0, 0.7):
        picked, entropy, lse = _head_stats(logits[None], targets[None], temperature)
        got = head_stats(logits, targets, temperature, block)
        for value, want in zip(got, (picked[0], entropy[0], lse[0])):
            assert value.dtype == torch.float32 and value.shape == (rows,)
            torch.testing.assert_close(value, want, atol=atol, rtol=0)
        want = _head_grad(logits[None], targets[None], lse, upstream[None], temperature)[0]
        grad = head_logits_grad_(logits.clone(), targets, got[2], upstream, temperature, block)
        assert grad.dtype == dtype and grad.shape == (rows, vocab)
        torch.testing.assert_close(grad.float(), want.float(), atol=atol, rtol=0)


def _interpreted() -> None:
    allow_scalar_loop_bounds()
    _check(torch.float32, "cpu", rows=3, vocab=300, block=16, atol=5e-5)  # parts of blocks, the last cut short
    _check(torch.float32, "cpu", rows=40, vocab=300, block=64, atol=5e-5)


def test_fused_head_matches_the_unfused_math_under_the_interpreter():
    run_interpreted("tests.test_fused_head")


@pytest.mark.gpu
def test_fused_head_matches_the_unfused_math_on_cuda():
    """bf16 at the default block, a vocabulary ending in a partial block, few rows (many parts) and many."""
    from rlspec.core.fused_head import BLOCK

    for rows in (3, 300):
        _check(torch.bfloat16, "cuda", rows=rows, vocab=151_936 + 77, block=BLOCK, atol=1e-4)
