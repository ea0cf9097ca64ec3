"""The CPU-checkable parts of `cuda_ipc`: persistent staging buckets, the engine-side receiver built once per
layout (name mapping checked there), and byte checksums compared on the device with one host sync."""

from __future__ import annotations

import pytest
import torch

from rlspec.models.factory import load_model, load_tokenizer
from rlspec.rollout.hf import HFEngine
from rlspec.spec import ModelSpec, RolloutSpec
from rlspec.sync import SyncError, checksums, compare_checksums
from rlspec.sync.base import word_views
from rlspec.sync.staging import Receiver, Staging, layout_key


def _engine(seed: int = 1) -> HFEngine:
    spec = ModelSpec()
    return HFEngine(load_model(spec, seed).eval(), load_tokenizer(spec), RolloutSpec(), "cpu")


def _weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    return list(load_model(ModelSpec(), seed).state_dict().items())


def _sync(staging: Staging, named, engine, receiver: Receiver | None = None) -> Receiver:
    staging.copy_in(named)
    receiver = receiver or Receiver(engine, staging.flats, staging.entries, staging.layout_id)
    receiver.copy()
    receiver.verify(staging.expected(named))
    return receiver


def test_checksums_are_exact_layout_free_and_see_any_changed_element():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1001, generator=g).to(torch.bfloat16)
    tensors = [base[1:], base[:7], torch.randn(6, 4, generator=g).t(), torch.zeros(3, dtype=torch.bool),
               torch.randn(0), torch.tensor(2.5, dtype=torch.float64)]
    copies = [t.contiguous().clone() for t in tensors]  # other storage, other alignment, contiguous
    assert torch.equal(checksums(tensors), checksums(copies))
    # a copy for the view at an odd offset and the transposed one; the 14-byte tensor is read as bytes
    assert [w is None for w in word_views(tensors[:3])] == [True, False, True]
    assert torch.equal(checksums(copies, word_views(copies)), checksums(copies))
    names = [f"t{i}" for i in range(len(tensors))]
    compare_checksums(names, checksums(tensors), checksums(copies))
    copies[0][500] = copies[0][500] * 1.0078125 + 1  # one element of the misaligned bf16 view
    copies[2][1, 3] = -copies[2][1, 3]  # a sign flip
    with pytest.raises(SyncError, match=r"2 weight\(s\) differ after sync: t0, t2 \(byte checksum of 't0'"):
        compare_checksums(names, checksums(tensors), checksums(copies))


def test_a_checksum_does_not_depend_on_how_its_rows_are_chunked(monkeypatch):
    """The rows of WEIGHT_PERIOD elements are weighted a chunk at a time (CHUNK_BYTES per device type): any chunk
    size gives the same int32 checksum, bit for bit, and the same float64 fingerprint to rounding."""
    from rlspec.sync import base

    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (5 * base.WEIGHT_PERIOD + 17,), dtype=torch.int32, generator=g)
    floats = torch.randn(3 * base.WEIGHT_PERIOD + 5, generator=g)
    want = base._weighted(words, torch.int32), base._weighted(floats, torch.float64)
    for rows in (1, 2, 4, 64):  # a chunk of 1 row, rows not a multiple of the chunk, one chunk for all
        monkeypatch.setitem(base.CHUNK_BYTES, "cpu", rows * base.WEIGHT_PERIOD * 4)
        assert int(base._weighted(words, torch.int32)) == int(want[0]), rows
        assert torch.allclose(base._weighted(floats, torch.float64), want[1], rtol=1e-12), rows


def test_staging_lays_out_once_aligned_and_round_trips_every_weight():
    named = _weights()
    staging = Staging(named, bucket_mb=1, layout_id="L0")
    assert staging.key == layout_key(_weights(3), 1) != layout_key(named, 2)
    assert sorted(staging.order) == list(range(len(named)))
    for flat, entries in zip(staging.flats, staging.entries):
        assert all(offset * flat.element_size() % 16 == 0 for _, _, offset, _ in entries)
        spans = [(o, o + n) for _, _, o, n in entries]
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])) and spans[-1][1] <= flat.numel()
    assert all(w is not None for views in staging.views for w in word_views(views))  # aligned: no copies to checksum
    staging.copy_in(named)
    got = {name: flat[o:o + n].view(shape) for flat, entries in zip(staging.flats, staging.entries)
           for name, shape, o, n in entries}
    assert all(torch.equal(got[name], t) for name, t in named)
    assert staging.nbytes == sum(t.numel() * t.element_size() for _, t in named)


def test_receiver_copies_into_the_engine_and_is_reused_across_pushes():
    engine = _engine()
    named = _weights()
    staging = Staging(named, bucket_mb=1, layout_id="L0")
    receiver = _sync(staging, named, engine)
    own = dict(engine.named_weights())
    assert all(torch.equal(own[n], t) for n, t in named)
    with torch.no_grad():
        for _, t in named:
            t.add_(0.25)
    _sync(staging, named, engine, receiver)  # the same buckets, the same opened receiver
    assert all(torch.equal(own[n], t) for n, t in named)


def test_wrong_bytes_fail_verification_naming_the_weight():
    engine = _engine()
    named = _weights()
    staging = Staging(named, bucket_mb=1, layout_id="L0")
    receiver = _sync(staging, named, engine)
    expected = staging.expected(named)
    with torch.no_grad():
        dict(engine.named_weights())["model.norm.weight"][3] += 1.0  # a write that went astray
    with pytest.raises(SyncError, match=r"1 weight\(s\) differ after sync: model\.norm\.weight"):
        receiver.verify(expected)


def test_receiver_refuses_missing_extra_and_repeated_names_before_writing():
    named = _weights()
    engine = _engine()
    before = {n: t.clone() for n, t in engine.named_weights()}
    cases = {
        r"never written: model\.norm\.weight": [(n, t) for n, t in named if n != "model.norm.weight"],
        r"does not have: model\.norm\.weights": [("model.norm.weights" if n == "model.norm.weight" else n, t)
                                                   for n, t in named],
        r"written more than once: model\.norm\.weight": named + [("model.norm.weight", dict(named)["model.norm.weight"])],
    }
    for message, source in cases.items():
        staging = Staging(source, bucket_mb=1, layout_id="L")
        staging.copy_in(source)
        with pytest.raises(SyncError, match=message):
            Receiver(engine, staging.flats, staging.entries, staging.layout_id)
    assert all(torch.equal(t, before[n]) for n, t in engine.named_weights())


def test_receiver_refuses_a_shape_mismatch():
    named = [(n, t.reshape(1, -1) if n == "model.norm.weight" else t) for n, t in _weights()]
    staging = Staging(named, bucket_mb=1, layout_id="L")
    with pytest.raises(SyncError, match=r"another shape on the engine than sent: model\.norm\.weight"):
        Receiver(_engine(), staging.flats, staging.entries, staging.layout_id)
