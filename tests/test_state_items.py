"""`state_items`: the single-process trainer's export, kept between syncs, follows every change of the model."""

from __future__ import annotations

import torch

from rlspec.models.factory import load_model
from rlspec.spec.schema import ModelSpec
from rlspec.core.weights import state_items


def _same_as_state_dict(model) -> None:
    items = state_items(model)
    state = model.state_dict()
    assert [name for name, _ in items] == list(state)
    for name, tensor in items:
        assert tensor.data_ptr() == state[name].data_ptr() and torch.equal(tensor, state[name]), name
        assert not tensor.requires_grad


def test_kept_views_follow_in_place_writes_moves_and_replaced_parameters():
    model = load_model(ModelSpec(), 0)
    first = state_items(model)
    assert state_items(model) is first  # nothing changed: no new walk
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # in place: the views see it
    assert state_items(model) is first
    _same_as_state_dict(model)

    model.to(torch.float64)  # new storage under the same Parameter objects
    moved = state_items(model)
    assert moved is not first and moved[0][1].dtype == torch.float64
    _same_as_state_dict(model)

    layer = model.model.layers[0].mlp.up_proj
    layer.weight = torch.nn.Parameter(torch.zeros_like(layer.weight))  # a new Parameter object
    replaced = dict(state_items(model))
    assert replaced["model.layers.0.mlp.up_proj.weight"].abs().sum() == 0
    _same_as_state_dict(model)

    model.model.norm.register_buffer("extra", torch.ones(2))  # a new persistent buffer
    assert "model.norm.extra" in dict(state_items(model))
    _same_as_state_dict(model)


def test_a_sharded_trainers_export_detaches_each_tensor_once(monkeypatch):
    """`merged_weights` (what an fsdp rank gathers at every push) detaches each tensor once: `state_dict()` then
    `detach` did it twice, and on FSDP2's DTensors each is a dispatch (about half of the export's host walk)."""
    from rlspec.core.trainer import merged_weights
    from rlspec.models.factory import load_model
    from rlspec.spec import ModelSpec

    model = load_model(ModelSpec(), 0)
    detach = torch.Tensor.detach
    calls = []

    def counted(self):
        calls.append(1)
        return detach(self)

    monkeypatch.setattr(torch.Tensor, "detach", counted)
    named = list(merged_weights(model))
    monkeypatch.setattr(torch.Tensor, "detach", detach)
    assert len(calls) == len(named) == len(model.state_dict())
    assert all(not t.requires_grad for _, t in named)
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in named)
    # detach=False (the fsdp gather, which reads the local shards without autograd): the model's own tensors
    calls.clear()
    monkeypatch.setattr(torch.Tensor, "detach", counted)
    own = list(merged_weights(model, detach=False))
    monkeypatch.setattr(torch.Tensor, "detach", detach)
    kept = model.state_dict(keep_vars=True)
    assert not calls and [n for n, _ in own] == list(kept) and all(t is kept[n] for n, t in own)
