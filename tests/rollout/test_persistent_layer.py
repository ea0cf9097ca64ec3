"""`persistent_layer.decode_layer` (a decoder layer of a decode step as one resident kernel) against the layer
written out in torch: on CPU its phases one launch each under Triton's interpreter (fp32; CI's CPU torch has no
Triton, so CI skips it and the device machine runs it), on CUDA in bf16 with grid-wide syncs, and inside the
decoder's step against the compiled layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlspec.rollout.persistent_layer import decode_layer
from tests.rollout.test_decode_kernels import _decode_layers, _rotate
from tests.triton_interpreter import allow_scalar_loop_bounds, run_interpreted


def _norm(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _attention(q, keys, values, valid):
    """SDPA in fp32 over the valid positions, q [M, heads, 1, D] against caches [M, Hkv, S, D]."""
    mask = torch.zeros(valid.shape, device=q.device).masked_fill_(~valid, float("-inf"))[:, None, None]
    return F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask, enable_gqa=True,
                                          scale=q.shape[-1] ** -0.5)


def _layer_case(dtype, device, rows, hidden=64, heads=4, kv_heads=2, dim=16, ffn=96, length=200, parts=3):
    """A layer's weights (scaled as a trained layer's: activations about N(0, 1)), a stream, its last MLP parts, and
    half-filled caches with rows of lengths 1..length (row 1 left-padded)."""
    torch.manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device=device) / shape[-1] ** 0.5).to(dtype)

    qkv_n = (heads + 2 * kv_heads) * dim
    case = dict(x=torch.randn(rows, hidden, device=device).to(dtype),
                delta=torch.randn(parts, rows, hidden, device=device) * 0.5,
                norm1=(1 + 0.1 * torch.randn(hidden, device=device)).to(dtype), wqkv=w(qkv_n, hidden),
                bqkv=(0.1 * torch.randn(qkv_n, device=device)).to(dtype),
                keys=torch.randn(rows, kv_heads, length, dim, device=device).to(dtype),
                values=torch.randn(rows, kv_heads, length, dim, device=device).to(dtype),
                wo=w(hidden, heads * dim), norm2=(1 + 0.1 * torch.randn(hidden, device=device)).to(dtype),
                w_gate_up=w(2 * ffn, hidden), w_down=w(hidden, ffn))
    lengths = torch.linspace(1, length, rows, device=device).long()
    valid = torch.arange(length, device=device)[None] < lengths[:, None]
    if rows > 1:
        valid[1, : int(lengths[1]) // 2] = False
    angles = torch.rand(rows, dim // 2, device=device) * 6.0
    cos, sin = (torch.cat((f(angles), f(angles)), -1).to(dtype) for f in (torch.cos, torch.sin))
    case.update(valid=valid.view(torch.uint8), lengths=lengths, write=lengths - 1, cos=cos, sin=sin)
    return case, heads


def _expected(case, heads, eps):
    """The layer in torch, rounding where the compiled layer rounds: (stream after attention, MLP output, caches)."""
    c = {k: v.clone() for k, v in case.items()}
    dtype, rows, dim = c["x"].dtype, c["x"].shape[0], c["keys"].shape[3]
    kv_heads = c["keys"].shape[1]
    summed = c["delta"][0]
    for part in c["delta"][1:]:
        summed = summed + part
    x = c["x"] + summed.to(dtype)
    qkv = F.linear(_norm(x, c["norm1"], eps), c["wqkv"], c["bqkv"]).view(rows, -1, dim)
    q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=1)
    at = torch.arange(rows, device=x.device)
    c["keys"][at, :, c["write"]] = _rotate(k, c["cos"][:, None], c["sin"][:, None])
    c["values"][at, :, c["write"]] = v
    att = _attention(_rotate(q, c["cos"][:, None], c["sin"][:, None])[:, :, None], c["keys"], c["values"],
                     c["valid"].bool()).to(dtype)
    x2 = x + F.linear(att.reshape(rows, -1), c["wo"]).to(dtype)
    gate, up = F.linear(_norm(x2, c["norm2"], eps), c["w_gate_up"]).chunk(2, dim=-1)
    y = (F.silu(gate.float()) * up.float()).to(dtype)
    return x2, F.linear(y.float(), c["w_down"].float()), c["keys"], c["values"]


def _run(case, heads, eps, counter, **kwargs):
    c = {k: v.clone() for k, v in case.items()}
    x, delta = decode_layer(c["x"], c["delta"], c["norm1"], c["wqkv"], c["bqkv"], c["keys"], c["values"], c["valid"],
                            c["lengths"], c["write"], c["cos"], c["sin"], c["wo"], c["norm2"], c["w_gate_up"],
                            c["w_down"], eps, c["keys"].shape[3] ** -0.5, heads, counter, **kwargs)
    return x, delta.sum(0), c["keys"], c["values"]


def _check(dtype, device, tolerance, rows_cases=(5, 1), **kwargs):
    """Stream, MLP output and caches against `_expected`, with a long cache (the rows' positions split: the merge
    phase runs) and a short one (not split)."""
    eps = 1e-6
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    for rows in rows_cases:
        for length in (520, 16):
            case, heads = _layer_case(dtype, device, rows, length=length)
            expected = _expected(case, heads, eps)
            got = _run(case, heads, eps, counter, **kwargs)
            for ours, theirs in zip(got, expected):
                torch.testing.assert_close(ours.float(), theirs.float(), atol=tolerance, rtol=tolerance)
    assert not counter.any()  # each launch leaves them at zero for the next


def _interpreted() -> None:
    allow_scalar_loop_bounds()
    _check(torch.float32, "cpu", 1e-4, phased=True)


def test_decode_layer_phases_match_torch_under_the_interpreter():
    run_interpreted("tests.rollout.test_persistent_layer")


@pytest.mark.gpu
def test_decode_layer_with_grid_syncs_matches_torch_on_cuda():
    """bf16, the 0.5B shape's sizes aside, synced and phased, one and two programs per SM: within bf16 rounding of
    the torch layer (the syncs order the phases: a missing one reads a half-written buffer)."""
    for kwargs in ({"phased": True}, {"programs_per_sm": 1}, {"programs_per_sm": 2}):
        _check(torch.bfloat16, "cuda", 5e-2, rows_cases=(5, 1, 48), **kwargs)


@pytest.mark.gpu
def test_persistent_layers_step_matches_the_compiled_layers_on_cuda():
    """The 0.5B shape's decode step at 48 rows: logits and caches with the persistent layers (synced and phased)
    against the compiled layers with the same decode kernels, to bf16 rounding."""
    compiled = _decode_layers({})
    for mode in ("synced", "phased"):
        fused = _decode_layers({"persistent_layers": mode})
        torch.testing.assert_close(fused[0], compiled[0], atol=0.15, rtol=0.05)
        assert (fused[0].argmax(-1) == compiled[0].argmax(-1)).float().mean() > 0.95
        for ours, theirs in zip(fused[1] + fused[2], compiled[1] + compiled[2]):
            torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0.05)


@pytest.mark.gpu
def test_synced_layers_sample_in_captured_graphs_what_phased_layers_sample():
    """The CUDA-graph sampler with the synced kernel (captured, replayed step after step, slots refilled as their
    samples end, the counters set back by every launch) against the same phases launched one by one: the same
    arithmetic on the same tiles, so the same tokens and log-probs bit for bit; a sync that let a phase read a
    half-written buffer, or a counter left behind, would change them."""
    from rlspec.models.factory import load_model
    from rlspec.rollout.static import GraphSampler
    from rlspec.spec import ModelSpec

    model = load_model(ModelSpec(preset="qwen2_0p5b_shape", dtype="bfloat16", attn_implementation="sdpa"), 0).cuda()
    torch.manual_seed(3)
    ids = torch.randint(0, 1000, (24, 12), device="cuda")
    mask = torch.ones_like(ids)
    mask[::3, :4] = 0
    out = {}
    for mode in ("synced", "phased"):
        sampler = GraphSampler(model, "cuda", persistent_layers=mode)
        out[mode] = sampler.sample(ids, mask, seed=5, max_new_tokens=96, temperature=1.0, top_p=1.0, eos=7, slots=8)
    assert torch.equal(out["synced"][0], out["phased"][0])
    assert torch.equal(out["synced"][1], out["phased"][1])


def test_persistent_layers_are_refused_without_the_decode_kernels():
    from rlspec.models.factory import load_model
    from rlspec.rollout.decoder import StaticDecoder
    from rlspec.spec import ModelSpec

    model = load_model(ModelSpec(), seed=0)
    assert StaticDecoder(model, sdpa=True).persistent_layers == "off"
    with pytest.raises(ValueError, match="persistent_layers must be 'off', 'synced' or 'phased'"):
        StaticDecoder(model, persistent_layers="on")
    with pytest.raises(ValueError, match="persistent_layers needs rope_attention"):  # CPU: no Triton kernels
        StaticDecoder(model, sdpa=True, persistent_layers="synced")
