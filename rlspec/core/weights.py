"""How a backend offers its full weights to a sync transport: the `WeightSource` protocol.

It lives in the core because it is the backend's side of the contract; `sync/` implements transports
on top of it. A weight source runs a transport's sender half next to the full weights: in-process for
single-process trainers, inside the trainer ranks for sharded ones (every rank joins the gather of the
sharded weights; rank 0 runs the sender).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol

import torch
from torch import Tensor

NamedTensors = Iterable[tuple[str, Tensor]]
SenderFn = Callable[[Optional[NamedTensors], Any], Any]


class WeightSource(Protocol):
    """Where the trainer's full weights can be produced; the one hook a transport's sender half uses."""

    def run_sender(self, fn: SenderFn, payload: Any, gather: bool = True) -> Any:
        """Run `fn(named_tensors, payload)` next to the weights and return its result.

        With `gather`, `named_tensors` iterates the full weights by Hugging Face state-dict name and
        `fn` must consume it to the end (on sharded trainers every rank takes part in each gather);
        without, it is None and nothing is gathered (rendezvous, teardown). `fn` and `payload` must
        be picklable (module-level functions or static methods) to reach remote ranks.
        """

    # Optional, for trainers with LoRA adapters (the `lora` transport needs it):
    # def run_adapter_sender(self, fn: SenderFn, payload: Any) -> Any:
    #     """Run `fn(adapter_tensors, payload)` next to the weights, with only the adapter tensors by their
    #     PEFT state-dict names (`...lora_A.default.weight`)."""


class LocalWeights:
    """A `WeightSource` for weights in this process, given as a callable returning `(name, tensor)`s
    (and, for a LoRA trainer, one returning only the adapter tensors)."""

    def __init__(self, export: Callable[[], NamedTensors], adapters: Callable[[], NamedTensors] | None = None) -> None:
        self.export = export
        if adapters is not None:
            self.adapters = adapters
            self.run_adapter_sender = lambda fn, payload: fn(self.adapters(), payload)

    def run_sender(self, fn: SenderFn, payload: Any, gather: bool = True) -> Any:
        return fn(self.export() if gather else None, payload)


def as_source(weights: "WeightSource | Callable[[], NamedTensors]") -> WeightSource:
    """Accept a `WeightSource` or a bare `export_weights`-style callable (wrapped as `LocalWeights`)."""
    return weights if hasattr(weights, "run_sender") else LocalWeights(weights)  # type: ignore[arg-type]


def send_beside(source, fn, payload, gather: bool = True) -> list:
    """Run a transport's sender half; one result per engine where the source sends from beside each engine (a
    colocated layout: each trainer rank feeds the engine on its own GPU, `run_senders`), else `[result]` for every
    engine (trainer rank 0, or a single-process trainer)."""
    if hasattr(source, "run_senders"):
        return source.run_senders(fn, payload, gather)
    return [source.run_sender(fn, payload, gather)]


def receive_beside(engine, fn, payloads: list) -> list:
    """Run a transport's engine half on the payloads of `send_beside`: engine i gets `payloads[i]` (one payload:
    every engine gets it). One result per engine (one for an in-process engine)."""
    if len(payloads) == 1:
        got = engine.receive(fn, payloads[0])
        return got if isinstance(got, list) else [got]
    return engine.receive_each(fn, payloads)


def collect_cpu(named: NamedTensors, _payload: Any = None) -> list[tuple[str, Tensor]]:
    """Sender function that brings the full weights back as CPU copies (e.g. to the driver)."""
    return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in named]


def gather_groups(named: NamedTensors, limit_bytes: int,
                  nbytes: Callable[[Tensor], int]) -> Iterator[list[tuple[str, Tensor]]]:
    """Consecutive groups of (name, tensor) of at most `limit_bytes` by `nbytes` (a larger tensor alone): the
    unit a sharded trainer gathers at once, so an export holds one group of full tensors, not the model."""
    group: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named:
        n = nbytes(tensor)
        if group and size + n > limit_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += n
    if group:
        yield group


EXPORT_BUFFER = "_rlspec_export_buffer"
"""Attribute that marks a buffer an export made for this push alone (`export_buffer`)."""


def export_buffer(numel: int, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A fresh flat buffer that an export lays full tensors out in, one after another, and hands over as views.
    Nothing else holds it, so a transport may send it as its bucket instead of copying the views into one
    (`sync.base.buckets`)."""
    buffer = torch.empty(numel, dtype=dtype, device=device)
    setattr(buffer, EXPORT_BUFFER, True)
    return buffer


def export_flat(tensors: list[tuple[Tensor, Tensor | None]]) -> Tensor | None:
    """The `export_buffer` that `tensors` (each with its `_base`, taken before any `detach`) lay out whole, in
    order and without gaps; None when they do not (then a transport copies them into a bucket of its own)."""
    base = tensors[0][1] if tensors else None
    if base is None or not getattr(base, EXPORT_BUFFER, False):
        return None
    offset = 0
    for tensor, owner in tensors:
        if owner is not base or tensor.storage_offset() != offset or not tensor.is_contiguous():
            return None
        offset += tensor.numel()
    return base.detach() if offset == base.numel() else None


def tied_aliases(model: torch.nn.Module) -> frozenset[str]:
    """The parameter names that are a second name of a parameter already named (a tied LM head: `lm_head.weight`
    is `model.embed_tokens.weight`). An export leaves them out, so a tied tensor crosses the wire once; the engine,
    built with the same ties, holds it under every name (`sync.base.check_mapping` counts a tensor written under
    any of its names as written). With LoRA (PEFT), the names are the base model's."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    once = {name for name, _ in base.named_parameters()}
    return frozenset(name.replace(".base_layer.", ".") for name, _ in base.named_parameters(remove_duplicate=False)
                     if name not in once)


def untied(named: NamedTensors, aliases: frozenset[str]) -> Iterator[tuple[str, Tensor]]:
    """`named` without the names in `aliases` (`tied_aliases`)."""
    return ((name, tensor) for name, tensor in named if name not in aliases)


_registrations = 0
"""Bumped whenever any module anywhere registers a parameter, buffer or submodule (torch's global hooks)."""
_watching = False
_state_views: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, list[Tensor], list[tuple[str, Tensor]]]]" = \
    weakref.WeakKeyDictionary()


def _registered(*_args) -> None:
    global _registrations
    _registrations += 1


def state_items(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """`model.state_dict()` as `(name, detached tensor)` pairs, kept between calls: what a single-process
    trainer exports at every sync.

    Walking a 24-layer model's state dict costs about 2 ms of host time, as much as a third of a 1.26 GB
    push over NVLink; checking the kept pairs costs about 0.05 ms. They are rebuilt when any parameter,
    buffer or submodule was registered since (torch's global registration hooks see `module.weight =
    Parameter(...)`, `load_state_dict(assign=True)`, wrapping) or a tensor's storage moved (`module.to`,
    `param.data = ...`). In-place writes (optimizer steps, `copy_`) need nothing: the pairs are views.
    Do not mutate the returned list.
    """
    global _watching
    if not _watching:
        from torch.nn.modules import module as nn_module

        nn_module.register_module_parameter_registration_hook(_registered)
        nn_module.register_module_buffer_registration_hook(_registered)
        nn_module.register_module_module_registration_hook(_registered)
        _watching = True
    kept = _state_views.get(model)
    if kept is not None:
        generation, sources, items = kept
        if generation == _registrations and all(s.data_ptr() == t.data_ptr() for s, (_, t) in zip(sources, items)):
            return items
    state = model.state_dict(keep_vars=True)
    items = [(name, value.detach()) for name, value in state.items()]
    _state_views[model] = (_registrations, list(state.values()), items)
    return items
