"""Buckets, fingerprints, and the in-process transports."""

from __future__ import annotations

import pytest
import torch

from rlspec.sync import SyncError, build_transport, buckets, compare_fingerprints, fingerprint
from rlspec.spec import SyncSpec


def named():
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(600, 600, generator=g)), ("b", torch.randn(7, generator=g)),
            ("c", torch.randn(5, 5, generator=g).to(torch.bfloat16)), ("d", torch.randn(200, 400, generator=g))]


def test_buckets_roundtrip_group_dtypes_and_respect_the_size_limit():
    out = list(buckets(named(), bucket_mb=1))
    got = {name: t for b in out for name, t in b.unpack()}
    for name, tensor in named():
        assert torch.equal(got[name], tensor) and got[name].dtype == tensor.dtype
    assert all(len({t.dtype for _, t in b.unpack()}) == 1 for b in out)
    fp32 = [b for b in out if b.flat.dtype == torch.float32]
    assert len(fp32) == 2  # a (1.4 MB) alone, being larger than a bucket; then b + d (320 KB)
    assert [n for n, _ in fp32[1].unpack()] == ["b", "d"]
    assert sum(b.nbytes for b in out) == sum(t.numel() * t.element_size() for _, t in named())


def test_bucket_meta_rebuilds_on_the_receiver():
    from rlspec.sync.base import Bucket

    bucket = next(buckets(named()[:2], bucket_mb=64))
    empty = Bucket.empty_like_meta(bucket.meta(), "cpu")
    empty.flat.copy_(bucket.flat)
    assert [n for n, _ in empty.unpack()] == ["a", "b"]
    assert torch.equal(dict(empty.unpack())["a"], named()[0][1])


def test_fingerprint_catches_a_changed_weight():
    expected = fingerprint(named())
    compare_fingerprints(expected, fingerprint(named()))
    tampered = named()
    tampered[3][1][10, 10] += 1e-3
    with pytest.raises(SyncError, match="'d' differs"):
        compare_fingerprints(expected, fingerprint(tampered))
    with pytest.raises(SyncError, match="lacks"):
        compare_fingerprints(expected, fingerprint(named()[:2]))


class DictEngine:
    """The smallest engine a transport can feed."""

    def __init__(self, weights):
        self.weights = {k: torch.zeros_like(v) for k, v in weights}

    def load_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.weights[name].copy_(tensor)

    def named_weights(self):
        return self.weights.items()

    def receive(self, fn, payload):
        fn(self, payload)


def test_checkpoint_transport_moves_and_verifies(tmp_path):
    engine = DictEngine(named())
    transport = build_transport("checkpoint", SyncSpec(bucket_mb=1), directory=tmp_path / "sync")
    transport.connect(engine)
    moved = transport.push(named, engine)
    assert moved == sum(t.numel() * t.element_size() for _, t in named())
    for name, tensor in named():
        assert torch.equal(engine.weights[name], tensor)
    transport.close()
