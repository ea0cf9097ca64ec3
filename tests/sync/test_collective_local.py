"""The `nccl` transport on gloo, with both halves in this process (no Ray): a push, and a bounded rendezvous."""

from __future__ import annotations

import time

import pytest
import torch

from rlspec.models import load_model, load_tokenizer
from rlspec.rollout.hf import HFEngine
from rlspec.spec.schema import ModelSpec, RolloutSpec, SyncSpec
from rlspec.sync import LocalWeights, SyncError, build_transport


def _engine(seed: int) -> HFEngine:
    spec = ModelSpec()
    return HFEngine(load_model(spec, seed), load_tokenizer(spec), RolloutSpec(), "cpu")


def test_push_moves_weights_and_verifies():
    trainer = load_model(ModelSpec(), 0)
    engine = _engine(1)
    transport = build_transport("nccl", SyncSpec(method="nccl", bucket_mb=1, timeout_s=20))
    source = LocalWeights(lambda: trainer.state_dict().items())
    try:
        transport.connect(engine, source)
        for _ in range(2):  # a second version over the same group
            with torch.no_grad():
                trainer.lm_head.weight.add_(0.01)
            assert transport.push(source, engine) > 0
            for name, tensor in engine.model.state_dict().items():
                assert torch.equal(tensor, trainer.state_dict()[name]), name
    finally:
        transport.close()
        transport.close()


class _AbsentEngine:
    """An engine that never joins the group (a dead or late peer)."""

    num_engines = 1

    def receive(self, fn, payload) -> None:
        time.sleep(0.1)


def test_rendezvous_times_out_instead_of_hanging():
    transport = build_transport("nccl", SyncSpec(method="nccl", timeout_s=2))
    start = time.monotonic()
    with pytest.raises(SyncError, match="timeout_s=2"):
        transport.connect(_AbsentEngine(), LocalWeights(lambda: iter(())))
    assert time.monotonic() - start < 10


def test_connect_without_weight_source_is_refused():
    with pytest.raises(SyncError, match="weight source"):
        build_transport("nccl", SyncSpec(method="nccl")).connect(_AbsentEngine())
