"""A verified push fails when the values arrive in the wrong places: a transposed weight, swapped attention heads,
an element offset. Each bug is put once on the sender (packing the buckets) and once on the engine (writing its
weights), for every transport that runs on CPU; `cuda_ipc`'s staging and receiver are checked on CPU here too.

`shared` moves nothing (trainer and engine hold one module), so it has no layout to get wrong and nothing to verify.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rlspec.models.factory import apply_lora, load_model, load_tokenizer
from rlspec.rollout.hf import HFEngine
from rlspec.spec import AlgorithmSpec, LoraSpec, ModelSpec, RolloutSpec, SyncSpec
from rlspec.sync import LocalWeights, SyncError, build_transport
from rlspec.sync import base as sync_base
from rlspec.sync.staging import Receiver, Staging

HEADS, HEAD_DIM = 4, 16  # tiny_qwen2: hidden 64


def transposed(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


def heads_swapped(t: torch.Tensor) -> torch.Tensor:
    """Rows of head 0 and head 1 exchanged (an interleave bug between q/k/v heads)."""
    return t.view(HEADS, -1, *t.shape[1:])[[1, 0, *range(2, HEADS)]].reshape(t.shape)


def rows_swapped(t: torch.Tensor) -> torch.Tensor:
    return t[[1, 0, *range(2, t.shape[0])]].contiguous()


def shifted(t: torch.Tensor) -> torch.Tensor:
    """Every element one place on (a bucket read at the wrong offset)."""
    return t.reshape(-1).roll(1).view(t.shape).contiguous()


BUGS = {"transposed": ("model.layers.0.self_attn.q_proj.weight", transposed),
        "heads_swapped": ("model.layers.1.self_attn.q_proj.weight", heads_swapped),
        "offset": ("model.layers.0.mlp.up_proj.weight", shifted)}


class _FakeRay(types.ModuleType):
    """The object store as a dict: the `ray` transport's two halves, run in this process."""

    class exceptions:
        GetTimeoutError = TimeoutError

    def __init__(self) -> None:
        super().__init__("ray")
        self.store: dict[int, torch.Tensor] = {}

    def is_initialized(self) -> bool:
        return True

    def put(self, value):
        self.store[len(self.store)] = value.clone()
        return len(self.store) - 1

    def get(self, refs, timeout=None):
        return [self.store[r] for r in refs]


class _Streamed:
    """A weight source outside this process's hands (a sharded trainer's): nccl's streamed path."""

    def __init__(self, export) -> None:
        self.export = export

    def run_sender(self, fn, payload, gather: bool = True):
        return fn(self.export() if gather else None, payload)


def _engine(lora_r: int = 0) -> HFEngine:
    spec = ModelSpec(lora=LoraSpec(r=lora_r))
    model = load_model(spec, 1)
    if lora_r:
        model = apply_lora(model, spec, 1)
    return HFEngine(model.eval(), load_tokenizer(spec), RolloutSpec(), "cpu")


def _push(method: str, source, engine, tmp_path, monkeypatch) -> None:
    if method == "ray":
        monkeypatch.setitem(sys.modules, "ray", _FakeRay())
    options = {"directory": tmp_path / "sync"} if method == "checkpoint" else {}
    transport = build_transport(method.split("-")[0], SyncSpec(method=method.split("-")[0], bucket_mb=1, timeout_s=20),
                                **options)
    try:
        transport.connect(engine, source)
        transport.push(source, engine)
    finally:
        transport.close()


def _source(method: str, trainer):
    export = lambda: trainer.state_dict().items()  # noqa: E731
    return _Streamed(export) if method == "nccl-streamed" else LocalWeights(export)


METHODS = ["checkpoint", "ray", "nccl-local", "nccl-streamed"]


@pytest.mark.parametrize("method", METHODS)
def test_a_correct_push_verifies(method, tmp_path, monkeypatch):
    trainer, engine = load_model(ModelSpec(), 0), _engine()
    _push(method, _source(method, trainer), engine, tmp_path, monkeypatch)
    own = dict(engine.named_weights())
    assert all(torch.equal(own[n], t) for n, t in trainer.state_dict().items())


@pytest.mark.parametrize("bug", BUGS)
@pytest.mark.parametrize("method", METHODS)
def test_a_packing_bug_on_the_sender_fails_verification(method, bug, tmp_path, monkeypatch):
    """The buckets carry the tensor in the wrong layout; the sender's fingerprint is taken before packing."""
    target, wrong = BUGS[bug]
    if method == "nccl-local":  # the cached layout's staging copy
        real_copy = Staging.copy_in

        def copy_in(self, named, bucket=None):
            real_copy(self, [(n, wrong(t) if n == target else t) for n, t in named], bucket)

        monkeypatch.setattr(Staging, "copy_in", copy_in)
    else:
        real_flatten = sync_base._flatten
        monkeypatch.setattr(sync_base, "_flatten",
                            lambda group: real_flatten([(n, wrong(t) if n == target else t, b) for n, t, b in group]))
    trainer = load_model(ModelSpec(), 0)
    with pytest.raises(SyncError, match=target.replace(".", r"\.")):
        _push(method, _source(method, trainer), _engine(), tmp_path, monkeypatch)


class _Misplacing(HFEngine):
    """An engine whose weight loader writes one tensor in the wrong layout."""

    bug: tuple[str, object]

    def load_weights(self, named_tensors) -> None:
        target, wrong = self.bug
        super().load_weights((n, wrong(t) if n == target else t) for n, t in named_tensors)


@pytest.mark.parametrize("bug", BUGS)
@pytest.mark.parametrize("method", ["checkpoint", "ray", "nccl-local"])
def test_a_layout_bug_on_the_engine_fails_verification(method, bug, tmp_path, monkeypatch):
    target, wrong = BUGS[bug]
    engine = _engine()
    if method == "nccl-local":  # the receiver copies straight into the engine's tensors
        real_copy = Receiver.copy

        def copy(self, bucket=None):
            real_copy(self, bucket)
            with torch.no_grad():
                weight = dict(engine.named_weights())[target]
                weight.copy_(wrong(weight.clone()))

        monkeypatch.setattr(Receiver, "copy", copy)
    else:
        engine.__class__ = _Misplacing
        engine.bug = (target, wrong)
    trainer = load_model(ModelSpec(), 0)
    with pytest.raises(SyncError, match=target.replace(".", r"\.")):
        _push(method, _source(method, trainer), engine, tmp_path, monkeypatch)


@pytest.mark.parametrize("wrong", [rows_swapped, shifted])
def test_lora_adapters_in_the_wrong_layout_fail_verification(wrong, tmp_path, monkeypatch):
    from rlspec.core.trainer import LocalTrainer

    spec = ModelSpec(lora=LoraSpec(r=4))
    trainer = LocalTrainer(spec, AlgorithmSpec(), 1.0, 8)
    target = next(n for n, _ in trainer.export_adapters() if "lora_A" in n)
    engine = _engine(lora_r=4)
    engine.__class__ = _Misplacing
    engine.bug = (target, wrong)
    source = LocalWeights(trainer.export_weights, adapters=trainer.export_adapters)
    with pytest.raises(SyncError, match=target.replace(".", r"\.")):
        _push("lora", source, engine, tmp_path, monkeypatch)


@pytest.mark.parametrize("bug", BUGS)
def test_cuda_ipc_staging_checks_the_trainers_tensors_not_its_own_copy(bug):
    """cuda_ipc's sender stages into buckets the engine maps; a staging bug must not check against itself."""
    target, wrong = BUGS[bug]
    named = list(load_model(ModelSpec(), 0).state_dict().items())
    staging = Staging(named, bucket_mb=1, layout_id="L0")
    staging.copy_in([(n, wrong(t) if n == target else t) for n, t in named])
    receiver = Receiver(_engine(), staging.flats, staging.entries, staging.layout_id)
    receiver.copy()
    with pytest.raises(SyncError, match=target.replace(".", r"\.")):
        receiver.verify(staging.expected(named))
