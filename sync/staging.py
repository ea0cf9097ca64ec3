"""What a channel keeps between pushes so that a push only moves bytes: the bucket layout, the sender's staging
buffers, the engine's receiver, and the phase timings every push reports.

A layout (names, shapes, dtypes and `sync.bucket_mb`) is planned once and changes rarely; a push compares the
export against it (one tuple per tensor, no device work) and reuses everything built for it:

- `Staging` (sender): flat buckets, one per dtype run of at most `bucket_mb`, each tensor at a 16-byte aligned
  offset; a push refills them with one fused copy per bucket. With `slots`, the buckets are views into that many
  reusable buffers of the largest bucket's size (the sender then holds `slots` buckets, not the whole model).
- `Receiver` (engine): the engine tensor each entry lands in and the bucket view it comes from, built once per
  layout after checking the name mapping (each engine weight written exactly once, no unknown name, same
  shapes); a push is one fused copy per bucket, plus with `sync.verify` one checksum per tensor (on CUDA one
  graph replay per bucket: `BucketChecksums`) and one host sync to compare them.

`Phases` times a push's steps on the host with `time.perf_counter` alone (no device synchronisation): device
work that is only enqueued shows up in the phase that later waits for it.
"""

from __future__ import annotations

import itertools
import time
import weakref
from typing import Sequence

import torch
from torch import Tensor

from .base import SyncError, check_mapping, checksum_launch, checksums, compare_checksums, word_views

ALIGN_BYTES = 16
"""Each tensor starts at a multiple of this in its bucket (vectorised copies, word checksums)."""


class Phases:
    """Host seconds per named step of one half of a push; a step that repeats (per bucket) accumulates."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        """The time since the previous mark belongs to `name`."""
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self._last
        self._last = now


def push_report(total_s: float, halves: dict[str, tuple[float, object]]) -> dict[str, float]:
    """One push's timings, flat: `total_s`, then per half (`sender`, `engine`) its phases as `<half>/<phase>` and
    `<half>/call`, the wall time of the call into that half beyond its own phases (for a rollout server: pickling,
    HTTP and the engine-thread hand-off). A half reports `{"times": {...}}`; several engines report a list, and
    the slowest engine's figure per phase is kept."""
    report = {"total_s": total_s}
    for half, (wall_s, result) in halves.items():
        results = result if isinstance(result, list) else [result]
        times: dict[str, float] = {}
        for one in results:
            for name, seconds in ((one or {}).get("times") or {}).items() if isinstance(one, dict) else ():
                times[name] = max(times.get(name, 0.0), seconds)
        report.update({f"{half}/{name}": seconds for name, seconds in times.items()})
        report[f"{half}/call"] = max(0.0, wall_s - sum(times.values()))
    return report


def layout_key(named: Sequence[tuple[str, Tensor]], bucket_mb: int) -> tuple:
    """What decides a layout: equal keys give equal buckets."""
    return bucket_mb, tuple((name, tuple(t.shape), t.dtype) for name, t in named)


def plan_buckets(named: Sequence[tuple[str, Tensor]], bucket_mb: int) -> list[dict]:
    """Group the tensors into buckets of one dtype and at most `bucket_mb` MB (a larger tensor alone), in export
    order per dtype. Each bucket: `dtype`, `numel` (padding included), `entries` `(name, shape, offset, numel)`
    and `sources` (the index in `named` of each entry)."""
    limit = bucket_mb * (1 << 20)
    groups: list[list[int]] = []
    filling: dict[torch.dtype, list[int]] = {}
    sizes: dict[torch.dtype, int] = {}
    for i, (_, tensor) in enumerate(named):
        size = tensor.numel() * tensor.element_size()
        if tensor.dtype not in filling or sizes[tensor.dtype] + size > limit:
            filling[tensor.dtype], sizes[tensor.dtype] = [], 0
            groups.append(filling[tensor.dtype])
        filling[tensor.dtype].append(i)
        sizes[tensor.dtype] += size
    plan = []
    for group in groups:
        first = named[group[0]][1]
        align = max(1, ALIGN_BYTES // first.element_size())
        entries, offset = [], 0
        for i in group:
            name, tensor = named[i]
            entries.append((name, tuple(tensor.shape), offset, tensor.numel()))
            offset += -(-tensor.numel() // align) * align
        plan.append({"dtype": first.dtype, "numel": offset, "entries": entries, "sources": group})
    return plan


def describe(plan: list[dict]) -> list[dict]:
    """The JSON-able part of a plan that a receiver needs (dtype by name, no source indices)."""
    return [{"dtype": str(b["dtype"]).removeprefix("torch."), "numel": b["numel"],
             "entries": [list(e) for e in b["entries"]]} for b in plan]


def flat_buffers(buckets: Sequence[tuple[torch.dtype, int]], device: torch.device | str,
                 slots: int | None = None) -> list[Tensor]:
    """One flat tensor per `(dtype, numel)` bucket: its own allocation, or with `slots` a view into one of
    `slots` byte buffers of the largest bucket's size (bucket `b` in buffer `b % slots`)."""
    if slots is None:
        return [torch.empty(numel, dtype=dtype, device=device) for dtype, numel in buckets]
    sizes = [numel * torch.empty(0, dtype=dtype).element_size() for dtype, numel in buckets]
    largest = max(sizes, default=0)
    pool = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(min(slots, len(sizes)))]
    return [pool[b % slots][:size].view(dtype) for b, ((dtype, _), size) in enumerate(zip(buckets, sizes))]


class BucketChecksums:
    """`checksums` of fixed tensors, bucket by bucket (captured again if their storage moves).

    On CUDA each bucket's reductions, one per tensor, are captured once in a CUDA graph and replayed: one launch
    instead of about 60 per bucket. Launching them one by one cost about 3 to 5 ms of host time per 1.26 GB
    push (291 tensors, H200) on each side. Elsewhere they are launched as they are.
    """

    def __init__(self, tensors: list[list[Tensor]]) -> None:
        self.tensors = tensors
        self.words = [word_views(bucket) for bucket in tensors]
        self.graphs: list | None = None
        self.outs: list[Tensor] = []
        self.captured: list[tuple[int, ...]] = []
        """Each bucket's tensors' addresses when captured."""
        self.launches: list = []
        """Each bucket's fused-kernel tables (`checksum_launch`) its graph reads."""

    def __call__(self, bucket: int | None = None) -> Tensor:
        """The checksums of one bucket's tensors, or of all (in entry order), enqueued where they live."""
        if bucket is None:
            parts = [self(b) for b in range(len(self.tensors))]
            return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
        tensors = self.tensors[bucket]
        if not tensors or tensors[0].device.type != "cuda":
            return checksums(tensors, self.words[bucket])
        if self.graphs is None or self._pointers(bucket) != self.captured[bucket]:
            self._capture()  # first use, or the tensors were re-allocated (an engine that freed its weights for
            # the train phase gets new storage back): a graph would read the old addresses
        self.graphs[bucket].replay()
        return self.outs[bucket].clone()  # the next replay overwrites the graph's own output

    def _pointers(self, bucket: int) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.tensors[bucket])

    def _capture(self) -> None:
        device = next(t.device for tensors in self.tensors for t in tensors)
        current = torch.cuda.current_stream(device)
        # the fused kernel's tables (`checksum_launch`), held as long as the graphs that read them; copied to the
        # device on the current stream, which the side stream then waits for
        self.launches = [checksum_launch(tensors, words) for tensors, words in zip(self.tensors, self.words)]
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up outside the capture
            for tensors, words, launch in zip(self.tensors, self.words, self.launches):
                checksums(tensors, words, launch)
        current.wait_stream(side)
        self.graphs, self.outs = [], []
        self.captured = [self._pointers(b) for b in range(len(self.tensors))]
        for tensors, words, launch in zip(self.tensors, self.words, self.launches):
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads of this process (a server's web workers, a trainer's loops) may touch
            # CUDA meanwhile; only this thread's calls must be capture-safe.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.outs.append(checksums(tensors, words, launch))
            self.graphs.append(graph)


class Staging:
    """Sender side: flat buckets of a fixed layout that each push refills.

    `entries[b]` lists `(name, shape, offset, numel)` of bucket `b`; `sources[b]` the index in the export of
    each; `order` the source index of every entry, bucket after bucket. The buckets live on `device` (default:
    the tensors'); with `slots` they share that many buffers, so bucket `b` must have left before bucket
    `b + slots` is copied in (the caller orders that).
    """

    def __init__(self, named: list[tuple[str, Tensor]], bucket_mb: int, layout_id: str,
                 device: torch.device | str | None = None, slots: int | None = None) -> None:
        self.key = layout_key(named, bucket_mb)
        self.layout_id = layout_id
        plan = plan_buckets(named, bucket_mb)
        self.description = describe(plan)
        self.entries: list[list[tuple[str, tuple[int, ...], int, int]]] = [b["entries"] for b in plan]
        self.sources: list[list[int]] = [b["sources"] for b in plan]
        device = device if device is not None else (named[0][1].device if named else "cpu")
        self.flats = flat_buffers([(b["dtype"], b["numel"]) for b in plan], device, slots)
        self.views = [[flat[o:o + n].view(shape) for _, shape, o, n in entries]
                      for flat, entries in zip(self.flats, self.entries)]
        self.source_sums: BucketChecksums | None = None
        """`checksums` of the export's tensors, kept (CUDA graphs) while the export yields the same tensors."""
        self._last_sources: list[weakref.ref] = []
        self.order = [i for group in self.sources for i in group]
        self.parts: list[dict] = []  # transport-specific (cuda_ipc: the exported handles)
        self.nbytes = sum(t.numel() * t.element_size() for _, t in named)

    def copy_in(self, named: list[tuple[str, Tensor]], bucket: int | None = None) -> None:
        """One fused copy per bucket (all buckets, or only `bucket`)."""
        for b in range(len(self.flats)) if bucket is None else (bucket,):
            torch._foreach_copy_(self.views[b], [named[i][1] for i in self.sources[b]])

    def expected(self, named: list[tuple[str, Tensor]], bucket: int | None = None) -> Tensor:
        """Checksums of the export's own tensors, in entry order (all buckets, or only `bucket`'s entries): taken
        from the trainer's tensors, not from the staged copies, so a packing or offset bug shows on the engine
        instead of being checked against itself. An export that yields the same tensors push after push (the
        standalone trainer's views) keeps their `BucketChecksums` (on CUDA, one graph replay per bucket)."""
        tensors = [[named[i][1] for i in group] for group in self.sources]
        same = len(self._last_sources) == len(self.order) and all(
            ref() is named[i][1] for ref, i in zip(self._last_sources, self.order))
        if same and self.source_sums is None:  # the same tensors as the last push (a gathered export's die with it)
            self.source_sums = BucketChecksums(tensors)
        elif not same:
            self.source_sums = None
            self._last_sources = [weakref.ref(named[i][1]) for i in self.order]
        if self.source_sums is not None:
            return self.source_sums(bucket)
        parts = [checksums(tensors[b]) for b in (range(len(tensors)) if bucket is None else (bucket,))]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


class Receiver:
    """Engine side: the sender's buckets (`flats`, opened or received into), and the engine tensor each entry
    is copied into.

    Built once per layout: the name mapping is checked here, so a push only copies (and verifies bytes). The
    engine's `named_weights()` must yield its live weight tensors, which are written in place; a receiver is
    kept only for the engine object it was built for.
    """

    def __init__(self, engine, flats: list[Tensor], entries: list[list], layout_id: str) -> None:
        own = list(engine.named_weights())
        self.names = [e[0] for bucket in entries for e in bucket]
        check_mapping(own, self.names)
        lookup = dict(own)
        self.flats = flats  # keeps cuda_ipc's mappings open
        self.dsts = [[lookup[e[0]] for e in bucket] for bucket in entries]
        self.srcs = [[flat[o:o + n].view(tuple(shape)) for _, shape, o, n in bucket] for flat, bucket in zip(flats, entries)]
        pairs = list(zip(self.names, itertools.chain(*self.dsts), itertools.chain(*self.srcs)))
        wrong = [f"{name} {tuple(d.shape)} <- {tuple(s.shape)}" for name, d, s in pairs if d.shape != s.shape]
        if wrong:
            raise SyncError(f"{len(wrong)} weight(s) have another shape on the engine than sent: {', '.join(wrong[:4])}")
        self.cast = [f"{name} ({s.dtype} -> {d.dtype})" for name, d, s in pairs if d.dtype != s.dtype]
        self.sums = BucketChecksums(self.dsts)
        self.layout_id = layout_id
        self.engine = weakref.ref(engine)

    def copy(self, bucket: int | None = None) -> None:
        """One fused copy per bucket (all buckets, or only `bucket`)."""
        for b in range(len(self.dsts)) if bucket is None else (bucket,):
            torch._foreach_copy_(self.dsts[b], self.srcs[b])

    def checksums(self, bucket: int | None = None) -> Tensor:
        """Checksums of the engine's weights, in entry order (all buckets, or only `bucket`'s entries), enqueued
        where they live (no host sync)."""
        if self.cast:
            raise SyncError(f"sync.verify compares bytes, and {len(self.cast)} weight(s) change dtype between trainer "
                            f"and engine: {', '.join(self.cast[:4])} (give both the same model.dtype, or verify=false)")
        return self.sums(bucket)

    def verify(self, expected: Tensor, actual: Tensor | None = None) -> None:
        """Compare the sender's checksums with the engine's (`actual`, or computed now): one host sync."""
        compare_checksums(self.names, expected, self.checksums() if actual is None else actual)
