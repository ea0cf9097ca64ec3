"""What every transport shares: the protocol, weight sources, flat buckets, and a weight fingerprint.

A transport has a driver part and two halves that run where the data is. The sender half runs next to
the trainer's full weights: `push` calls `source.run_sender(fn, payload)`, and the weight source runs
`fn(named_tensors, payload)` in-process (standalone) or inside the trainer ranks (all ranks join the
gather of the sharded weights; rank 0 runs `fn`). The receiver half runs where the engine's weights
live: `engine.receive(fn, payload)` runs `fn(engine, payload)` in-process or in the engine's process.
Transports that copy from beside the engine (`cuda_ipc`, `ray`) use `send_beside` / `receive_beside`
instead: in a colocated layout each trainer rank runs the sender half for the engine on its own GPU, and
each engine takes its own rank's payload, so no weight byte crosses GPUs.
So engines know no transport, and backends know none either: they only yield weights.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, Protocol, Sequence

import torch
from torch import Tensor

from ..core.weights import (LocalWeights, NamedTensors, SenderFn, WeightSource, as_source, collect_cpu,  # noqa: F401
                            export_flat, receive_beside, send_beside)
from ..errors import RunError
from . import fused_sums

class SyncError(RunError):
    """A transfer failed, timed out, or the engine's weights did not verify (a run failure: exit 1)."""


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
    """Group tensors into flat buckets of at most `bucket_mb` MB (a larger tensor gets its own bucket).

    A group that lays out a fresh export buffer whole (`export_buffer`: a sharded trainer's gathered group of the
    same size) is sent as that buffer, without a copy."""
    limit = bucket_mb * (1 << 20)
    pending: dict[torch.dtype, list[tuple[str, Tensor, Tensor | None]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for name, tensor in named:
        base = tensor._base  # before `detach`, which forgets it
        tensor = tensor.detach()
        size = tensor.numel() * tensor.element_size()
        if pending.get(tensor.dtype) and sizes[tensor.dtype] + size > limit:
            yield _flatten(pending.pop(tensor.dtype))
            sizes[tensor.dtype] = 0
        pending.setdefault(tensor.dtype, []).append((name, tensor, base))
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + size
    for group in pending.values():
        if group:
            yield _flatten(group)


def _flatten(group: list[tuple[str, Tensor, Tensor | None]]) -> Bucket:
    entries, offset = [], 0
    for name, tensor, _ in group:
        entries.append((name, tuple(tensor.shape), offset, tensor.numel()))
        offset += tensor.numel()
    flat = export_flat([(t, base) for _, t, base in group])
    if flat is None:
        flat = torch.cat([t.reshape(-1) for _, t, _ in group]) if len(group) > 1 else group[0][1].reshape(-1).clone()
    return Bucket(flat, entries)


def fingerprint(named: NamedTensors) -> dict[str, tuple[float, float, float]]:
    """Per-tensor (sum, sum of squares, position-weighted sum) in float64: equal weights give equal fingerprints,
    and the weighted sum (`position_weights`) changes when elements move (a transposed weight, swapped heads, an
    offset), which the first two cannot see.

    Computed where the tensors live, then brought to the host once per device (not once per tensor).
    """
    prints = Fingerprints()
    for name, tensor in named:
        prints.add(name, tensor)
    return prints.result()


class Fingerprints:
    """`fingerprint`, one tensor at a time as a sender yields them (before they are packed into buckets, so a
    packing or offset bug is not checked against itself); `result()` brings them to the host."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.stats: list[Tensor] = []

    def add(self, name: str, tensor: Tensor) -> None:
        t = tensor.detach().to(torch.float64).reshape(-1)
        self.stats.append(torch.stack([t.sum(), (t * t).sum(), _weighted(t, torch.float64)]))
        self.names.append(name)

    def tap(self, named: NamedTensors) -> Iterator[tuple[str, Tensor]]:
        """`named` unchanged, each tensor fingerprinted as it passes."""
        for name, tensor in named:
            self.add(name, tensor)
            yield name, tensor

    def result(self) -> dict[str, tuple[float, float, float]]:
        by_device: dict[torch.device, list[int]] = {}
        for i, stat in enumerate(self.stats):
            by_device.setdefault(stat.device, []).append(i)
        host: dict[int, tuple[float, float, float]] = {}
        for indices in by_device.values():
            values = torch.stack([self.stats[i] for i in indices]).cpu().tolist()
            host.update({i: tuple(v) for i, v in zip(indices, values)})  # type: ignore[misc]
        return {name: host[i] for i, name in enumerate(self.names)}


def compare_fingerprints(expected: dict, actual: dict, rtol: float = 1e-6) -> None:
    """Raise `SyncError` naming the first tensor whose fingerprint differs."""
    missing = sorted(set(expected) - set(actual))
    if missing:
        raise SyncError(f"engine lacks {len(missing)} weight(s) after sync, e.g. {missing[0]!r}")
    for name, (s, q, w) in expected.items():
        a_s, a_q, a_w = actual[name]
        scale = rtol * max(1.0, abs(q) ** 0.5)
        if abs(a_q - q) > rtol * max(1.0, abs(q)) or abs(a_s - s) > scale:
            raise SyncError(f"weight {name!r} differs after sync: sum {a_s:.6g} vs {s:.6g}, sumsq {a_q:.6g} vs {q:.6g}")
        if abs(a_w - w) > scale:
            raise SyncError(f"weight {name!r} holds the right values in the wrong places after sync (a transposed or "
                            f"shifted tensor, permuted heads, a wrong offset): position-weighted sum {a_w:.6g} vs "
                            f"{w:.6g}")


# --- position weights: what makes a fingerprint or checksum see where each element is -----------------------

WEIGHT_PERIOD = 1 << 16
"""Element i of a tensor gets the weight `row[i // WEIGHT_PERIOD] * col[i % WEIGHT_PERIOD]`: two small tables
instead of one the size of the largest tensor, and no two positions of a tensor below 2**32 elements alike."""
CHUNK_BYTES = {"cuda": 64 << 20, "cpu": 16 << 20}
"""Per device type, the temporary of the rows of `WEIGHT_PERIOD` elements weighted at once, whatever the tensor.
On CUDA fewer, larger chunks launch fewer kernels (a 7B push's byte checksums were ~900 chunks of 16 MB, ~7
launches each: 108 ms on the engine of a 99 ms push, two H200s); on the host a chunk that stays in cache is
faster (16 MB took half the time of 64 MB on a 2-core CPU)."""
_position_tables: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}


def _mix(index: Tensor) -> Tensor:
    """A pseudo-random odd 32-bit integer per int64 `index` (a multiply-xorshift hash), as int64 in [0, 2**32)."""
    h = (index + 1) * 0x9E3779B1 & 0xFFFFFFFF
    h = (h ^ (h >> 16)) * 0x45D9F3B & 0xFFFFFFFF
    h = (h ^ (h >> 16)) * 0x45D9F3B & 0xFFFFFFFF
    return (h ^ (h >> 16)) | 1


def position_weights(index: Tensor, dtype: torch.dtype) -> Tensor:
    """The weight of each int64 `index`: odd int32 (wrapping) for `torch.int32`, else in (-1, 1) as `dtype`."""
    h = _mix(index)
    if dtype == torch.int32:
        return (h - (h >= 1 << 31).long() * (1 << 32)).to(torch.int32)
    return ((h.to(torch.float64) - 2.0 ** 31) / 2.0 ** 31).to(dtype)


def _tables(device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(column weights, row weights), `WEIGHT_PERIOD` of each, made once per device and dtype (before any CUDA
    graph capture: `BucketChecksums` warms up first)."""
    key = (device, dtype)
    if key not in _position_tables:
        index = torch.arange(WEIGHT_PERIOD, device=device)
        _position_tables[key] = (position_weights(index, dtype), position_weights(index + (1 << 40), dtype))
    return _position_tables[key]


def _weighted(flat: Tensor, dtype: torch.dtype) -> Tensor:
    """Σ_i weight(i) * flat[i] of a 1-D tensor, accumulated in `dtype` (int32 wraps modulo 2**32, exact and
    order-free; float64 as exact as float64 sums are)."""
    cols, row_weights = _tables(flat.device, dtype)
    rows, tail = divmod(flat.numel(), WEIGHT_PERIOD)
    if rows + bool(tail) > WEIGHT_PERIOD:
        raise SyncError(f"a tensor of {flat.numel()} elements is past what the sync fingerprint weighs "
                        f"({WEIGHT_PERIOD ** 2}); use sync.verify=false")
    # each row's column-weighted sum into one vector (two kernels a chunk), then one weighted sum over the rows
    sums = torch.empty(rows + bool(tail), dtype=dtype, device=flat.device)
    chunk = max(1, CHUNK_BYTES.get(flat.device.type, CHUNK_BYTES["cpu"]) // (WEIGHT_PERIOD * sums.element_size()))
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        block = flat[start * WEIGHT_PERIOD:stop * WEIGHT_PERIOD].view(stop - start, WEIGHT_PERIOD).to(dtype) * cols
        torch.sum(block, dim=1, dtype=dtype, out=sums[start:stop])
    if tail:
        sums[rows] = (flat[rows * WEIGHT_PERIOD:].to(dtype) * cols[:tail]).sum(dtype=dtype)
    return (sums * row_weights[:len(sums)]).sum(dtype=dtype)


# --- a rollout server's engine thread ------------------------------------------------------------------------

_engine_thread = threading.local()


def bind_engine_thread(submit: Callable[..., None]) -> None:
    """Called by a rollout server's engine thread on itself: `submit(fn, *args)` queues `fn(*args)` on that
    thread and returns at once. A transport's engine half can then start a push as soon as the trainer's
    side announces it (through the transport's own channel), before the trainer's bridge call arrives."""
    _engine_thread.submit = submit


def engine_thread_submit() -> Callable[..., None] | None:
    """The current thread's `submit` when it is a rollout server's engine thread, else None (an in-process
    engine, a Ray actor)."""
    return getattr(_engine_thread, "submit", None)


# --- the engine-side check that every sync ends with ------------------------------------------------------

def is_adapter(name: str) -> bool:
    """A LoRA adapter tensor (PEFT names them `...lora_A...` / `...lora_B...`)."""
    return "lora_" in name


def write_weights(engine, named: NamedTensors, written: list[str]) -> None:
    """Copy `named` into `engine` by name, appending every name offered to `written` (unknown ones too, so
    `verify_written` can list them all instead of failing on the first)."""
    own = {name for name, _ in engine.named_weights()}

    def tap():
        for name, tensor in named:
            written.append(name)
            if name in own:
                yield name, tensor

    engine.load_weights(tap())


def verify_written(engine, written: list[str], expected: dict | None,
                   scope: Callable[[str], bool] | None = None) -> None:
    """Engine side, after a sync: each of the engine's weights in `scope` was written exactly once, no name
    was written that the engine lacks, and (with `expected`) the fingerprints match the sender's.

    Tied weights share one storage under several names (Qwen2's embedding and LM head): the storage counts
    as written when any of its names was, so a sender that yields both names and one that yields only one
    are both complete. The same *name* written twice within one sync is an error: it means two source
    tensors were mapped onto one engine weight. Raises `SyncError` listing every missing, extra and
    repeated name.
    """
    own = [(name, t) for name, t in engine.named_weights() if scope is None or scope(name)]
    check_mapping(own, written)
    if expected:
        names = set(expected)
        compare_fingerprints(expected, fingerprint((n, t) for n, t in own if n in names))


def check_mapping(own: list[tuple[str, Tensor]], written: list[str]) -> None:
    """The name half of `verify_written`, over the engine's weights `own` (in scope) and the names sent."""
    if not own:
        raise SyncError("the engine holds no weights this transport writes (for sync.method=lora: an engine "
                        "without LoRA adapters)")
    counts = Counter(written)
    aliases: dict[tuple, list[str]] = {}
    for name, tensor in own:
        aliases.setdefault((tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)), []).append(name)
    missing = sorted(n for names in aliases.values() if not any(a in counts for a in names) for n in names)
    known = {name for name, _ in own}
    extra = sorted(n for n in counts if n not in known)
    repeated = sorted(n for n, c in counts.items() if c > 1)
    if missing or extra or repeated:
        parts = [f"{len(l)} {what}: {_names(l)}" for l, what in
                 ((missing, "engine weight(s) never written"), (extra, "name(s) the engine does not have"),
                  (repeated, "name(s) written more than once")) if l]
        raise SyncError(f"the weight name mapping is not one-to-one ({len(own)} engine weights, "
                        f"{len(counts)} names sent): " + "; ".join(parts))


# --- byte checksums: the device-side fingerprint ------------------------------------------------------------

def checksums(tensors: Sequence[Tensor], words: Sequence[Tensor | None] | None = None,
              launch: tuple[Tensor, ...] | None = None) -> Tensor:
    """One int32 per tensor, computed where the tensors live with no host sync: the tensor's bytes read as
    32-bit words (as bytes when their count is not a multiple of 4), each times an odd weight of its position
    (`position_weights`), summed modulo 2**32.

    Integer arithmetic is exact and order-free, so equal bytes in equal places give equal checksums whatever the
    reduction's order; changing any one element changes the checksum (the weights are odd, so invertible modulo
    2**32), and so does moving elements (a transposed weight, swapped heads, a wrong offset). A few kernels per
    tensor and no float64 copies: this is the fingerprint for transports that move bytes unchanged (dtype
    included). `words` (from `word_views`, for tensors whose storage stays put) saves the per-call view work.
    On CUDA with Triton, the tensors whose bytes are aligned int32 words take one launch for them all
    (`sync.fused_sums`, the same sums; `launch`: its tables, kept by a captured graph), the rest their own.
    """
    words = word_views(tensors) if words is None else words
    fused = _fused(tensors, words)
    if fused:
        sums = fused_sums.fused_checksums([words[i] for i in fused], *_tables(tensors[0].device, torch.int32),
                                          WEIGHT_PERIOD, launch)
        if len(fused) == len(words):
            return sums
        by_index = dict(zip(fused, sums))  # the others (bytes, or not aligned) one by one below
    else:
        by_index = {}
    sums = [by_index[i] if i in by_index else
            _weighted(w if w is not None else _words(t.detach().reshape(-1).clone()), torch.int32)
            for i, (t, w) in enumerate(zip(tensors, words))]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int32)


def checksum_launch(tensors: Sequence[Tensor], words: Sequence[Tensor | None]) -> tuple[Tensor, ...] | None:
    """The tables `checksums(tensors, words)` launches its one kernel with (`sync.fused_sums.tables`), or None
    where it launches none: for a captured graph to hold."""
    fused = _fused(tensors, words)
    return fused_sums.tables([words[i] for i in fused]) if fused else None


def _fused(tensors: Sequence[Tensor], words: Sequence[Tensor | None]) -> list[int]:
    """The tensors whose checksums the one kernel takes (aligned int32 words on CUDA; past WEIGHT_PERIOD**2
    words `_weighted` says why not)."""
    device = tensors[0].device if tensors else None
    return [i for i, w in enumerate(words) if fused_sums.usable(w, device) and w.numel() <= WEIGHT_PERIOD ** 2]


def word_views(tensors: Sequence[Tensor]) -> list[Tensor | None]:
    """Each tensor's bytes as the words `checksums` adds, as a view of its storage; None where that needs a
    copy (bytes not contiguous, or not 4-byte aligned)."""
    return [_words(t.detach()) if t.is_contiguous() else None for t in tensors]


def _words(flat: Tensor) -> Tensor | None:
    flat = flat.reshape(-1).view(torch.uint8)
    if flat.numel() % 4:
        return flat
    return None if flat.data_ptr() % 4 else flat.view(torch.int32)


def compare_checksums(names: Sequence[str], expected: Tensor, actual: Tensor) -> None:
    """Raise `SyncError` naming every tensor whose checksum differs (one host sync when all agree)."""
    expected = expected.to(actual.device)
    if expected.shape != actual.shape:
        raise SyncError(f"{len(actual)} checksums computed for {len(expected)} sent")
    if torch.equal(expected, actual):
        return
    bad = (expected != actual).nonzero().flatten().tolist()
    first = bad[0]
    raise SyncError(f"{len(bad)} weight(s) differ after sync: {_names([names[i] for i in bad])} (byte checksum of "
                    f"{names[first]!r}: {int(actual[first]) & 0xFFFFFFFF:#010x} on the engine, "
                    f"{int(expected[first]) & 0xFFFFFFFF:#010x} sent)")


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
