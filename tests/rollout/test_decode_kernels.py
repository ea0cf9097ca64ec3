"""The decode step's Triton kernels against what they replace: `live_attention` (attention over each row's live
cache positions) against SDPA over the whole masked cache, `skinny_linear` (split-K) against `F.linear`,
`gated_mlp` against the fused gate/up `F.linear` and `silu(gate) * up`. On CUDA compiled in bf16; on CPU under
Triton's interpreter in fp32 where Triton is installed (CPU-only torch ships without it, so CI skips that case;
the device machine runs both)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from rlspec.rollout.gated_mlp import config_for as gated_config_for
from rlspec.rollout.gated_mlp import gated_mlp_eager
from rlspec.rollout.live_attention import live_attention_eager, splits_for
from rlspec.rollout.skinny_linear import config_for, skinny_linear_eager
from tests.triton_interpreter import allow_scalar_loop_bounds, run_interpreted

HEADS, KV_HEADS, DIM = 14, 2, 64


def _case(dtype, device, rows=6, length=200):
    torch.manual_seed(0)
    q = torch.randn(rows, 1, HEADS, DIM, dtype=dtype, device=device).transpose(1, 2)  # the decoder's layout
    keys = torch.randn(rows, KV_HEADS, length, DIM, dtype=dtype, device=device)
    values = torch.randn_like(keys)
    lengths = torch.tensor([1, 37, 64, 130, 200, 65][:rows], device=device)
    valid = torch.arange(length, device=device)[None] < lengths[:, None]
    valid[3, :10] = False  # a left-padded prompt
    keys[1, :, 37:] = 1e4  # past a row's length: never read (a read would swamp its scores)
    return q, keys, values, valid, lengths


def _reference(q, keys, values, valid):
    mask = torch.zeros(valid.shape, device=q.device).masked_fill_(~valid, float("-inf"))[:, None, None]
    return F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask,
                                          enable_gqa=True, scale=DIM ** -0.5)


def _check(dtype, device, tolerance):
    q, keys, values, valid, lengths = _case(dtype, device)
    expected = _reference(q, keys, values, valid)
    for splits in (1, 3, 4):
        out = live_attention_eager(q, keys, values, valid.view(torch.uint8), lengths, DIM ** -0.5, splits)
        assert out.shape == (6, 1, HEADS, DIM) and out.dtype == dtype
        torch.testing.assert_close(out.transpose(1, 2).float(), expected, atol=tolerance, rtol=tolerance)
    valid[0] = False  # an empty slot (every position masked) stays finite, as under SDPA's finite mask
    out = live_attention_eager(q, keys, values, valid.view(torch.uint8), lengths, DIM ** -0.5, 3)
    assert torch.isfinite(out.float()).all()


def _rotate(x, cos, sin):
    """The compiled layer's RoPE (`StaticDecoder._rotate`) in fp32, rounded once to x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    return (xf * cos.float() + torch.cat((-xf[..., half:], xf[..., :half]), -1) * sin.float()).to(x.dtype)


def _check_rope(dtype, device, tolerance):
    """`live_attention_rope` from a fused q/k/v row, given as the projection in the model dtype or as fp32 split-K
    parts with a bias: the new token's rotated k and its v land in the caches at `write` (and nothing else
    changes), and the output is attention of the rotated q over the updated caches."""
    q, keys, values, valid, lengths = _case(dtype, device)
    rows, width = q.shape[0], (HEADS + 2 * KV_HEADS) * DIM
    parts = torch.randn(3, rows, width, device=device)
    bias = torch.randn(width, device=device).to(dtype)
    summed = parts[0] + bias.float()
    for part in parts[1:]:
        summed = summed + part
    angles = torch.rand(rows, DIM // 2, device=device) * 6.0
    cos, sin = (torch.cat((f(angles), f(angles)), -1).to(dtype) for f in (torch.cos, torch.sin))
    write = lengths - 1
    for qkv, given, given_bias in ((summed.to(dtype), summed.to(dtype), None), (summed.to(dtype), parts, bias)):
        q_new, k_new, v_new = qkv.view(rows, -1, DIM).split((HEADS, KV_HEADS, KV_HEADS), dim=1)
        expected_keys, expected_values = keys.clone(), values.clone()
        at = torch.arange(rows, device=device)
        expected_keys[at, :, write] = _rotate(k_new, cos[:, None], sin[:, None])
        expected_values[at, :, write] = v_new
        expected = _reference(_rotate(q_new, cos[:, None], sin[:, None])[:, :, None], expected_keys,
                              expected_values, valid)
        for splits in (1, 3, 4):
            cache_k, cache_v = keys.clone(), values.clone()
            out = live_attention_eager(given, cache_k, cache_v, valid.view(torch.uint8), lengths, DIM ** -0.5, splits,
                                       rope=(cos, sin, write), heads=HEADS, bias=given_bias)
            assert out.shape == (rows, 1, HEADS, DIM) and out.dtype == dtype
            assert torch.equal(cache_v, expected_values)
            if dtype == torch.float32:
                assert torch.equal(cache_k, expected_keys)
            else:
                torch.testing.assert_close(cache_k, expected_keys, atol=tolerance, rtol=tolerance)
            torch.testing.assert_close(out.transpose(1, 2).float(), expected, atol=tolerance, rtol=tolerance)


def _check_linear(dtype, device, tolerance):
    torch.manual_seed(0)
    for m, n, k in ((5, 100, 300), (64, 130, 896), (70, 64, 500)):
        x, weight = torch.randn(m, k, dtype=dtype, device=device), torch.randn(n, k, dtype=dtype, device=device)
        expected = x.float() @ weight.float().T
        for config in (config_for(m, n, k, sms=132), {"splits": 3, "block_m": 16, "block_n": 32, "block_k": 64}):
            parts = skinny_linear_eager(x, weight, **config)
            assert parts.dtype == torch.float32 and parts.shape[1:] == (m, n)
            torch.testing.assert_close(parts.sum(0), expected, atol=tolerance * k ** 0.5, rtol=tolerance)


def _gated_reference(x, weight):
    """Today's decode MLP before the down projection: gate and up rounded to x's dtype, silu(gate) * up in fp32."""
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def _check_gated(dtype, device, tolerance):
    """Ragged M (5, 70: a part-filled row block) and F (40, 24: a part-filled column block), K not a multiple of
    the K block; weights scaled so gate and up are about N(0, 1), as in a trained layer."""
    torch.manual_seed(0)
    for m, f, k in ((5, 40, 96), (16, 64, 128), (70, 24, 200)):
        x = torch.randn(m, k, dtype=dtype, device=device)
        weight = (torch.randn(2 * f, k, device=device) / k ** 0.5).to(dtype)
        expected = _gated_reference(x, weight).float()
        configs = (gated_config_for(m),
                   {"block_m": 16, "block_n": 32, "block_k": 64, "warps": 4, "stages": 2},
                   {"block_m": 64, "block_n": 16, "block_k": 128, "warps": 8, "stages": 3})
        for config in configs:
            out = gated_mlp_eager(x, weight, **config)
            assert out.shape == (m, f) and out.dtype == dtype
            torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def _interpreted() -> None:
    """`_check`, `_check_linear` and `_check_gated` in fp32 under Triton's interpreter (run in a fresh process: the
    interpreter is chosen when the kernels are defined). fp32 only: the interpreter's bf16 dot is wrong (CUDA checks
    bf16 below)."""
    allow_scalar_loop_bounds()
    _check(torch.float32, "cpu", 1e-5)
    _check_rope(torch.float32, "cpu", 1e-5)
    _check_linear(torch.float32, "cpu", 1e-5)
    _check_gated(torch.float32, "cpu", 1e-5)


def test_kernels_match_torch_under_the_interpreter():
    run_interpreted("tests.rollout.test_decode_kernels")


@pytest.mark.gpu
def test_live_attention_matches_masked_sdpa_on_cuda():
    _check(torch.bfloat16, "cuda", 2e-2)


@pytest.mark.gpu
def test_live_attention_rope_writes_the_cache_and_matches_sdpa_on_cuda():
    """bf16: a rotated k may round to the neighbouring bf16 value where the kernel contracts a multiply-add that
    torch rounds apart, so the keys are compared within a bf16 step (the values are copied: equal)."""
    _check_rope(torch.bfloat16, "cuda", 2e-2)


@pytest.mark.gpu
def test_skinny_linear_matches_linear_on_cuda():
    _check_linear(torch.bfloat16, "cuda", 1e-2)


@pytest.mark.gpu
def test_gated_mlp_matches_linear_and_silu_on_cuda():
    """bf16: where cuBLAS sums in another order, gate or up may round to the neighbouring bf16 value (one step:
    under 0.8%), and y rounds once more, so y within 2% (and 0.02 absolute)."""
    _check_gated(torch.bfloat16, "cuda", 2e-2)


def _decode_layers(kernels: dict) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """One compiled decode step of the 0.5B shape (bf16, 48 rows) over a half-filled random cache, with the decode
    kernels `kernels` (`StaticDecoder` flags): its logits and the caches after it."""
    from rlspec.models.factory import load_model
    from rlspec.rollout.decoder import StaticDecoder
    from rlspec.spec import ModelSpec

    model = load_model(ModelSpec(preset="qwen2_0p5b_shape", dtype="bfloat16", attn_implementation="sdpa"), 0).cuda()
    decoder = StaticDecoder(model, sdpa=True, **kernels)
    decoder.fuse_weights()
    decoder.compile_blocks(layers=True)
    torch.manual_seed(1)
    keys, values = decoder.new_cache(48, 256, "cuda")
    for cache in keys + values:
        cache.normal_()
    lengths = torch.randint(1, 256, (48,), device="cuda")
    valid = torch.arange(256, device="cuda")[None] < lengths[:, None]
    ids = torch.randint(0, 1000, (48, 1), device="cuda")
    with torch.no_grad():
        logits = decoder.forward(ids, lengths[:, None] - 1, (lengths - 1)[:, None], valid[:, None], keys, values,
                                 compiled=True, lengths=lengths).float()
    return logits, keys, values


def _same_top_up_to_ties(ours: Tensor, theirs: Tensor, tolerance: float) -> None:
    """Each row's top token is theirs, or a near tie: their logit of our top token within twice `tolerance` (the
    logits' own bound) of their best. A random-init model's logits are flat (rows with two tokens a few hundredths
    apart are common), so a share of equal argmaxes depends on the weights drawn, not on the kernels."""
    mine = ours.argmax(-1)
    best = theirs.max(-1).values
    gap = best - theirs.gather(-1, mine[..., None])[..., 0]
    assert (gap <= 2 * tolerance).all(), f"rows whose top tokens differ by more than a near tie: {gap.max():.4f}"
    assert (mine == theirs.argmax(-1)).float().mean() > 0.5  # most rows are no tie at all


@pytest.mark.gpu
def test_decode_step_with_the_kernels_matches_the_plain_one_on_cuda():
    """Logits with live attention (RoPE and the cache writes in its kernel), split-K projections and the gated
    MLP kernel equal those with SDPA and cuBLAS, to bf16 rounding; so do the caches the step wrote."""
    fast = _decode_layers({"live_attention": True, "skinny": True, "gated_mlp": True})
    plain = _decode_layers({"live_attention": False, "skinny": False, "gated_mlp": False})
    torch.testing.assert_close(fast[0], plain[0], atol=0.15, rtol=0.05)
    _same_top_up_to_ties(fast[0], plain[0], 0.15)
    for ours, theirs in zip(fast[1] + fast[2], plain[1] + plain[2]):
        torch.testing.assert_close(ours, theirs, atol=0.1, rtol=0.05)


@pytest.mark.gpu
def test_rope_attention_matches_the_compiled_rotation_and_cache_writes_on_cuda():
    """`rope_attention` (with q/k/v from cuBLAS, and from split-K parts summed in the kernel: `skinny_qkv`) against
    the compiled layer's RoPE and index_put cache writes before live attention, all else the same: the first
    layer's keys within a bf16 step (a rotation, or a sum in another order, may round the other way), its values
    equal from the same GEMM, every cache within bf16 rounding, and the logits close."""
    apart = _decode_layers({"rope_attention": False})
    for kernels in ({"rope_attention": True, "skinny_qkv": False}, {"rope_attention": True, "skinny_qkv": True}):
        fused = _decode_layers(kernels)
        torch.testing.assert_close(fused[1][0], apart[1][0], atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(fused[2][0], apart[2][0], atol=1e-2, rtol=1e-2)
        if not kernels["skinny_qkv"]:
            assert torch.equal(fused[2][0], apart[2][0])
        for ours, theirs in zip(fused[1] + fused[2], apart[1] + apart[2]):
            torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0.05)
        torch.testing.assert_close(fused[0], apart[0], atol=0.1, rtol=0.05)
        _same_top_up_to_ties(fused[0], apart[0], 0.1)


@pytest.mark.gpu
def test_live_attention_compiles_inside_a_captured_graph():
    """The custom op under torch.compile, captured in a CUDA graph, follows the lengths written before a replay."""
    from rlspec.rollout.live_attention import live_attention

    q, keys, values, valid, lengths = _case(torch.bfloat16, "cuda")
    keys[1, :, 37:] = torch.randn_like(keys[1, :, 37:])  # this test's second lengths read them
    valid8 = valid.view(torch.uint8)
    attend = torch.compile(lambda *a: live_attention(*a, DIM ** -0.5), dynamic=False)
    out = attend(q, keys, values, valid8, lengths)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(q, keys, values, valid8, lengths)
    lengths.fill_(150)
    valid.copy_(torch.arange(valid.shape[1], device="cuda")[None] < 150)
    graph.replay()
    torch.testing.assert_close(out.float(), _reference(q, keys, values, valid), atol=2e-2, rtol=2e-2)


def test_splits_fill_the_device_without_parts_shorter_than_a_block():
    assert splits_for(64, 2, 384, sms=132) == 1  # 128 (row, K/V head) programs: no merge kernel
    assert splits_for(16, 2, 1152, sms=132) == 9  # 32 programs: 9 parts (264 / 32, and 9 blocks of 128)
    assert splits_for(8, 2, 384, sms=132) == 3  # capped: three 128-position blocks


def test_gated_mlp_is_off_and_refused_without_cuda():
    from rlspec.models.factory import load_model
    from rlspec.rollout.decoder import StaticDecoder
    from rlspec.spec import ModelSpec

    model = load_model(ModelSpec(), seed=0)
    assert not StaticDecoder(model, sdpa=True).gated_mlp  # the CPU path stays F.linear and silu(gate) * up
    with pytest.raises(ValueError, match="gated_mlp needs Triton and a CUDA model"):
        StaticDecoder(model, gated_mlp=True)
