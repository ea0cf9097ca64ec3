"""How a backend offers its full weights to a sync transport: the `WeightSource` protocol.

It lives in the core because it is the backend's side of the contract; `sync/` implements transports
on top of it. A weight source runs a transport's sender half next to the full weights: in-process for
single-process trainers, inside the trainer ranks for sharded ones (every rank joins the gather of the
sharded weights; rank 0 runs the sender).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional, Protocol

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
