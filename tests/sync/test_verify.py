"""The engine-side check every sync ends with: each engine weight written exactly once, fingerprints equal."""

from __future__ import annotations

import pytest
import torch

from rlspec.models.factory import load_model, load_tokenizer
from rlspec.rollout.hf import HFEngine
from rlspec.spec import LoraSpec, ModelSpec, RolloutSpec, SyncSpec
from rlspec.sync import LocalWeights, SyncError, build_transport, verify_written, write_weights
from rlspec.core.trainer import LocalTrainer

TIED = ("model.embed_tokens.weight", "lm_head.weight")


def _engine(seed: int = 1, lora_r: int = 0) -> HFEngine:
    spec = ModelSpec(lora=LoraSpec(r=lora_r))
    model = load_model(spec, seed)
    if lora_r:
        from rlspec.models.factory import apply_lora

        model = apply_lora(model, spec, seed)
    return HFEngine(model.eval(), load_tokenizer(spec), RolloutSpec(), "cpu")


def _trainer_weights():
    return dict(load_model(ModelSpec(), 0).state_dict())


def _sync(engine, named, expected=None):
    written: list[str] = []
    write_weights(engine, named, written)
    verify_written(engine, written, expected)


def test_complete_mapping_passes_and_tied_weights_may_come_under_one_name():
    weights = _trainer_weights()
    assert all(name in weights for name in TIED)
    _sync(_engine(), weights.items())
    only_one_alias = [(n, t) for n, t in weights.items() if n != "lm_head.weight"]
    engine = _engine()
    _sync(engine, only_one_alias)
    assert torch.equal(engine.model.lm_head.weight, weights["model.embed_tokens.weight"])


def test_a_missing_tensor_fails_the_sync_and_is_named():
    weights = _trainer_weights()
    dropped = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(SyncError, match=r"1 engine weight\(s\) never written: model\.layers\.1\.mlp\.down_proj\.weight"):
        _sync(_engine(), [(n, t) for n, t in weights.items() if n != dropped])
    with pytest.raises(SyncError, match=r"never written: lm_head\.weight, model\.embed_tokens\.weight"):
        _sync(_engine(), [(n, t) for n, t in weights.items() if n not in TIED])


def test_extra_and_repeated_names_fail_the_sync():
    weights = _trainer_weights()
    renamed = [("model.layers.0.mlp.up_proj.weights" if n.endswith("layers.0.mlp.up_proj.weight") else n, t)
               for n, t in weights.items()]
    with pytest.raises(SyncError, match=r"name\(s\) the engine does not have: model\.layers\.0\.mlp\.up_proj\.weights"):
        _sync(_engine(), renamed)
    twice = list(weights.items()) + [("model.norm.weight", weights["model.norm.weight"])]
    with pytest.raises(SyncError, match=r"written more than once: model\.norm\.weight"):
        _sync(_engine(), twice)


def test_fingerprint_mismatch_fails_the_sync():
    from rlspec.sync import fingerprint

    weights = _trainer_weights()
    expected = fingerprint(weights.items())
    expected["model.norm.weight"] = (expected["model.norm.weight"][0] + 1.0, *expected["model.norm.weight"][1:])
    with pytest.raises(SyncError, match="model.norm.weight' differs"):
        _sync(_engine(), weights.items(), expected)


@pytest.mark.parametrize("method", ["checkpoint", "nccl"])
def test_transports_refuse_a_source_missing_one_tensor(method, tmp_path):
    weights = _trainer_weights()
    source = LocalWeights(lambda: ((n, t) for n, t in weights.items() if n != "model.norm.weight"))
    engine = _engine()
    options = {"directory": tmp_path / "sync"} if method == "checkpoint" else {}
    transport = build_transport(method, SyncSpec(method=method, timeout_s=20), **options)
    try:
        transport.connect(engine, source)
        with pytest.raises(SyncError, match=r"never written: model\.norm\.weight"):
            transport.push(source, engine)
    finally:
        transport.close()


def test_lora_moves_only_adapters_and_the_engine_matches_the_trainer():
    spec = ModelSpec(lora=LoraSpec(r=4))
    from rlspec.spec import AlgorithmSpec

    trainer = LocalTrainer(spec, AlgorithmSpec(lr=1e-2), 1.0, 8)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.01)
    engine = _engine(seed=0, lora_r=4)
    source = LocalWeights(trainer.export_weights, adapters=trainer.export_adapters)
    transport = build_transport("lora", SyncSpec(method="lora"))
    transport.connect(engine, source)
    moved = transport.push(source, engine)
    adapters = dict(trainer.export_adapters())
    assert moved == sum(t.numel() * t.element_size() for t in adapters.values()) > 0
    got = dict(engine.named_weights())
    assert all(torch.equal(got[n], t) for n, t in adapters.items())
    with pytest.raises(SyncError, match="without LoRA adapters"):
        transport.push(source, _engine(seed=0))
