"""The decode step's L2 prefetch table, built on CPU (the prefetch kernel itself needs a Hopper GPU: `tests/test_gpu.py`)."""

from __future__ import annotations

import pytest
import torch

from rlspec.models.factory import load_model
from rlspec.rollout import l2_prefetch
from rlspec.rollout.decoder import StaticDecoder
from rlspec.spec import ModelSpec


def test_chunks_cover_each_tensor_once_in_pieces_of_16_bytes():
    tensors = [torch.empty(1000, dtype=torch.bfloat16), torch.empty(37, 3, dtype=torch.float32),
               torch.empty(4096, dtype=torch.uint8)[:8]]
    addresses, sizes = l2_prefetch.chunks(tensors, chunk=512)
    pieces = sorted(zip(addresses, sizes))
    for tensor in tensors[:2]:
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        mine = [(a, s) for a, s in pieces if start <= a < start + nbytes]
        assert mine[0][0] == start
        assert all(a + s == b for (a, s), (b, _) in zip(mine, mine[1:])), "contiguous, no overlap"
        assert all(s % 16 == 0 and 0 < s <= 512 for _, s in mine)
        assert start + nbytes - (mine[-1][0] + mine[-1][1]) < 16, "only a sub-16-byte end is left out"
    assert sum(s for _, s in pieces) == 2000 + 37 * 3 * 4 // 16 * 16
    assert not [a for a in addresses if tensors[2].data_ptr() <= a < tensors[2].data_ptr() + 8], "under 16 bytes"



def test_the_decoder_prefetches_each_layers_mlp_with_the_next_layers_attention():
    model = load_model(ModelSpec(), seed=0).eval()
    decoder = StaticDecoder(model)
    decoder.fuse_weights()
    stretches = decoder._prefetch_stretches()
    layers = model.model.layers
    assert len(stretches) == len(layers) + 1
    fused = decoder._fused

    def attention(i):
        wqkv, bqkv, _ = fused[i]
        o = layers[i].self_attn.o_proj
        return [w for w in (wqkv, bqkv, o.weight, o.bias) if w is not None]

    assert stretches[0] == attention(0)
    for i in range(len(layers)):
        mlp = [fused[i][2], layers[i].mlp.down_proj.weight]
        assert stretches[i + 1] == mlp + (attention(i + 1) if i + 1 < len(layers) else [])
    every = {t.data_ptr() for s in stretches for t in s}
    read = {w.data_ptr() for i in range(len(layers)) for w in attention(i) + [fused[i][2], layers[i].mlp.down_proj.weight]}
    assert every == read


def test_asking_for_prefetches_without_a_hopper_gpu_is_refused():
    model = load_model(ModelSpec(), seed=0).eval()
    with pytest.raises(ValueError, match="prefetch_rows needs"):
        StaticDecoder(model, prefetch_rows=64)
