"""What every transport shares: the protocol, weight sources, flat buckets, and a weight fingerprint.

A transport has a driver part and two halves that run where the data is. The sender half runs next to
the trainer's full weights: `push` calls `source.run_sender(fn, payload)`, and the weight source runs
`fn(named_tensors, payload)` in-process (standalone) or inside the trainer ranks (all ranks join the
gather of the sharded weights; rank 0 runs `fn`). The receiver half runs where the engine's weights
live: `engine.receive(fn, payload)` runs `fn(engine, payload)` in-process or in the engine's process.
So engines know no transport, and backends know none either: they only yield weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, Protocol

import torch
from torch import Tensor

from ..weights import LocalWeights, NamedTensors, SenderFn, WeightSource, as_source, collect_cpu  # noqa: F401

class SyncError(RuntimeError):
    """A transfer failed, timed out, or the engine's weights did not verify."""


class Transport(Protocol):
    name: ClassVar[str]

    def connect(self, engine, weights: "WeightSource | None" = None) -> None:
        """Set up the channel eagerly (rendezvous while every party is known to be alive); transports whose
        sender half holds a connection (`nccl`) need the weight source here too."""

    def push(self, weights: "WeightSource | Callable[[], NamedTensors]", engine) -> int:
        """Move the trainer's current weights into `engine`; return the bytes moved. `weights` is a
        `WeightSource` (or a bare callable yielding `(name, tensor)`, run in this process)."""

    @staticmethod
    def receive(engine, payload) -> None:
        """Engine side: apply `payload` to `engine` (an in-process engine)."""

    def close(self) -> None:
        """Tear the channel down. Safe to call twice."""


@dataclass
class Bucket:
    """Tensors of one dtype flattened into one contiguous buffer."""

    flat: Tensor
    entries: list[tuple[str, tuple[int, ...], int, int]]
    """(name, shape, offset, numel) per tensor."""

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def unpack(self, flat: Tensor | None = None) -> Iterator[tuple[str, Tensor]]:
        flat = self.flat if flat is None else flat
        for name, shape, offset, numel in self.entries:
            yield name, flat[offset:offset + numel].view(shape)

    def meta(self) -> dict:
        """What a receiver needs to allocate and unpack the buffer."""
        return {"dtype": str(self.flat.dtype).removeprefix("torch."), "numel": self.flat.numel(),
                "entries": self.entries}

    @staticmethod
    def empty_like_meta(meta: dict, device: torch.device | str) -> "Bucket":
        flat = torch.empty(meta["numel"], dtype=getattr(torch, meta["dtype"]), device=device)
        return Bucket(flat, [tuple(e) for e in meta["entries"]])  # type: ignore[misc]


def buckets(named: NamedTensors, bucket_mb: int) -> Iterator[Bucket]:
    """Group tensors into flat buckets of at most `bucket_mb` MB (a larger tensor gets its own bucket)."""
    limit = bucket_mb * (1 << 20)
    pending: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for name, tensor in named:
        tensor = tensor.detach()
        size = tensor.numel() * tensor.element_size()
        if pending.get(tensor.dtype) and sizes[tensor.dtype] + size > limit:
            yield _flatten(pending.pop(tensor.dtype))
            sizes[tensor.dtype] = 0
        pending.setdefault(tensor.dtype, []).append((name, tensor))
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + size
    for group in pending.values():
        if group:
            yield _flatten(group)


def _flatten(group: list[tuple[str, Tensor]]) -> Bucket:
    entries, offset = [], 0
    for name, tensor in group:
        entries.append((name, tuple(tensor.shape), offset, tensor.numel()))
        offset += tensor.numel()
    flat = torch.cat([t.reshape(-1) for _, t in group]) if len(group) > 1 else group[0][1].reshape(-1).clone()
    return Bucket(flat, entries)


def fingerprint(named: NamedTensors) -> dict[str, tuple[float, float]]:
    """Per-tensor (sum, sum of squares) in float64: equal weights give equal fingerprints."""
    out = {}
    for name, tensor in named:
        t = tensor.detach().to(torch.float64)
        out[name] = (float(t.sum()), float((t * t).sum()))
    return out


def compare_fingerprints(expected: dict, actual: dict, rtol: float = 1e-6) -> None:
    """Raise `SyncError` naming the first tensor whose fingerprint differs."""
    missing = sorted(set(expected) - set(actual))
    if missing:
        raise SyncError(f"engine lacks {len(missing)} weight(s) after sync, e.g. {missing[0]!r}")
    for name, (s, q) in expected.items():
        a_s, a_q = actual[name]
        if abs(a_q - q) > rtol * max(1.0, abs(q)) or abs(a_s - s) > rtol * max(1.0, abs(q) ** 0.5):
            raise SyncError(f"weight {name!r} differs after sync: sum {a_s:.6g} vs {s:.6g}, sumsq {a_q:.6g} vs {q:.6g}")
