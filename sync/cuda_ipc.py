"""`cuda_ipc`: trainer and engine processes on one GPU; the engine copies straight out of the trainer's memory.

The sender half (next to the full weights: the standalone trainer, or trainer rank 0) keeps a `Staging`:
flat GPU buckets of at most `sync.bucket_mb`, one per dtype run, laid out once and kept across pushes. Each
push copies the weights into them (one fused multi-tensor copy per bucket) and synchronises; the CUDA IPC
handles of the buckets are exported once per layout, not per push (and not per tensor, which costs a
handle open per tensor). The engine half keeps a `Receiver`: the buckets opened once per layout, checked
once against the engine's weight names (each written exactly once, no unknown name, same shapes), and the
engine tensors each entry lands in. A push is then: sender copy + sync, one bridge call, engine copy
(one fused copy per bucket) + sync. A new layout (other names, shapes or dtypes, or another `bucket_mb`)
frees the old buckets and opens the new ones.

Memory: the sender holds one copy of the exported weights (for a 0.5B bf16 model about 1.3 GB) on the
trainer's GPU from the first push until `close()`; the engine holds only the mappings.

With `sync.verify`, the sender computes a byte checksum per tensor (`checksums`) from its own tensors and
the engine compares it with the checksums of its weights after the copy, on the device, with one host sync.

Both processes must see the same physical GPU; the handle carries the device's UUID and the engine
refuses a handle from another device instead of reading the wrong memory.
"""

from __future__ import annotations

import itertools
import uuid
import weakref

import torch
from torch import Tensor

from . import register
from .base import SyncError, as_source, check_mapping, checksums, compare_checksums, word_views

ALIGN_BYTES = 16
"""Each tensor starts at a multiple of this in its bucket (vectorised copies, word checksums)."""

_STAGED: dict[str, "Staging"] = {}
"""Sender process: the persistent buckets of each channel."""
_OPENED: dict[str, "Receiver"] = {}
"""Engine process: the opened buckets of each channel."""
_LAYOUTS = itertools.count()


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def layout_key(named: list[tuple[str, Tensor]], bucket_mb: int) -> tuple:
    return bucket_mb, tuple((name, tuple(t.shape), t.dtype) for name, t in named)


class Staging:
    """Sender side: flat buckets of a fixed layout that each push refills.

    `entries[b]` lists `(name, shape, offset, numel)` of bucket `b` (a tensor larger than a bucket gets its
    own); `order` is the source index of every entry, bucket after bucket.
    """

    def __init__(self, named: list[tuple[str, Tensor]], bucket_mb: int, layout_id: str) -> None:
        self.key = layout_key(named, bucket_mb)
        self.layout_id = layout_id
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
        self.entries: list[list[tuple[str, tuple[int, ...], int, int]]] = []
        self.flats: list[Tensor] = []
        self.views: list[list[Tensor]] = []
        self.sources: list[list[int]] = []
        for group in groups:
            dtype = named[group[0]][1].dtype
            align = max(1, ALIGN_BYTES // named[group[0]][1].element_size())
            entries, offset = [], 0
            for i in group:
                name, tensor = named[i]
                entries.append((name, tuple(tensor.shape), offset, tensor.numel()))
                offset += -(-tensor.numel() // align) * align
            flat = torch.empty(offset, dtype=dtype, device=named[group[0]][1].device)
            self.entries.append(entries)
            self.flats.append(flat)
            self.views.append([flat[o:o + n].view(shape) for _, shape, o, n in entries])
            self.sources.append(group)
        self.order = [i for group in groups for i in group]
        self.staged = [view for views in self.views for view in views]  # entry order
        self.words = word_views(self.staged)
        self.parts: list[dict] = []  # the exported handles (set by the sender half)
        self.nbytes = sum(t.numel() * t.element_size() for _, t in named)

    def copy_in(self, named: list[tuple[str, Tensor]]) -> None:
        for views, sources in zip(self.views, self.sources):
            torch._foreach_copy_(views, [named[i][1] for i in sources])

    def expected(self) -> Tensor:
        """Checksums of the staged tensors, in entry order (equal to the sources' after `copy_in`: the entries
        are disjoint, which `__init__` lays out and the tests check)."""
        return checksums(self.staged, self.words)


class Receiver:
    """Engine side: the sender's buckets (opened), and the engine tensor each entry is copied into.

    Built once per layout: the name mapping is checked here, so a push only copies (and verifies bytes).
    The engine's `named_weights()` must yield its live weight tensors, which are written in place.
    """

    def __init__(self, engine, flats: list[Tensor], entries: list[list], layout_id: str) -> None:
        own = list(engine.named_weights())
        self.names = [e[0] for bucket in entries for e in bucket]
        check_mapping(own, self.names)
        lookup = dict(own)
        self.flats = flats  # keeps the mappings open
        self.dsts = [[lookup[e[0]] for e in bucket] for bucket in entries]
        self.srcs = [[flat[o:o + n].view(tuple(shape)) for _, shape, o, n in bucket] for flat, bucket in zip(flats, entries)]
        wrong = [f"{name} {tuple(d.shape)} <- {tuple(s.shape)}" for name, d, s in
                 zip(self.names, itertools.chain(*self.dsts), itertools.chain(*self.srcs)) if d.shape != s.shape]
        if wrong:
            raise SyncError(f"{len(wrong)} weight(s) have another shape on the engine than sent: {', '.join(wrong[:4])}")
        self.weights = list(itertools.chain(*self.dsts))
        self.words = word_views(self.weights)
        self.layout_id = layout_id
        self.engine = weakref.ref(engine)

    def copy(self) -> None:
        for dsts, srcs in zip(self.dsts, self.srcs):
            torch._foreach_copy_(dsts, srcs)

    def verify(self, expected: Tensor) -> None:
        compare_checksums(self.names, expected, checksums(self.weights, self.words))


@register("cuda_ipc")
class CudaIpcTransport:
    def __init__(self, sync_spec, **_options) -> None:
        self.spec = sync_spec
        self.channel_id = f"rlspec-ipc-{uuid.uuid4().hex[:12]}"
        self.source = None
        self.engine = None

    def connect(self, engine, weights=None) -> None:
        pass  # the buckets are laid out and exported on the first push

    def push(self, weights, engine) -> int:
        self.source, self.engine = as_source(weights), engine
        sent = self.source.run_sender(CudaIpcTransport.send, {"id": self.channel_id, "bucket_mb": self.spec.bucket_mb,
                                                               "verify": self.spec.verify})
        engine.receive(CudaIpcTransport.receive, sent)
        return sent["bytes"]

    @staticmethod
    def send(named, payload) -> dict:
        """Sender half: refill the channel's buckets (laying them out and exporting their handles when the
        weights' layout is new), synchronise, and describe them."""
        from torch.multiprocessing.reductions import reduce_tensor

        named = [(name, tensor.detach()) for name, tensor in named]
        off_gpu = next((t.device for _, t in named if not t.is_cuda), None)
        if off_gpu is not None:
            raise SyncError(f"sync.method=cuda_ipc: the trainer's weights are on {off_gpu}, not a GPU "
                            "(use hardware.device=cuda, or another sync.method)")
        channel = payload["id"]
        staging = _STAGED.get(channel)
        if staging is None or staging.key != layout_key(named, payload["bucket_mb"]):
            _STAGED.pop(channel, None)  # free the old buckets before allocating the new ones
            staging = Staging(named, payload["bucket_mb"], f"{channel}/{next(_LAYOUTS)}")
            staging.parts = [{"handle": reduce_tensor(flat), "entries": entries}
                             for flat, entries in zip(staging.flats, staging.entries)]
            _STAGED[channel] = staging
        staging.copy_in(named)
        expected = staging.expected() if payload["verify"] else None
        device = named[0][1].device if named else torch.device("cuda", torch.cuda.current_device())
        torch.cuda.synchronize(device)  # the engine reads these bytes from another process
        return {"id": channel, "layout": staging.layout_id, "parts": staging.parts, "bytes": staging.nbytes,
                "expected": None if expected is None else expected.cpu(), "device_uuid": _device_uuid(device)}

    @staticmethod
    def receive(engine, payload) -> None:
        """Engine half: open the buckets if their layout is new, copy into the engine's weights, verify."""
        device = torch.device(getattr(engine, "device", "cpu"))
        if device.type != "cuda":
            raise SyncError(f"sync.method=cuda_ipc: the engine runs on {device}, not on the trainer's GPU")
        if _device_uuid(device) != payload["device_uuid"]:
            raise SyncError(f"sync.method=cuda_ipc: the engine's GPU ({_device_uuid(device)}) is not the trainer's "
                            f"({payload['device_uuid']}); cuda_ipc needs both on one GPU (use sync.method=nccl)")
        receiver = _OPENED.get(payload["id"])
        if receiver is None or receiver.layout_id != payload["layout"] or receiver.engine() is not engine:
            _OPENED.pop(payload["id"], None)  # close the old mappings
            index = device.index if device.index is not None else torch.cuda.current_device()
            receiver = Receiver(engine, [_open(part["handle"], index) for part in payload["parts"]],
                                [part["entries"] for part in payload["parts"]], payload["layout"])
            _OPENED[payload["id"]] = receiver
        receiver.copy()
        if payload["expected"] is not None:
            receiver.verify(payload["expected"])  # waits for the copies
        else:
            torch.cuda.synchronize(device)  # the copies are done before the sender refills its buckets

    @staticmethod
    def forget(_engine, channel_id) -> None:
        """Engine half of `close`: drop the channel's mappings."""
        _OPENED.pop(channel_id, None)

    @staticmethod
    def release(_named, channel_id) -> None:
        """Sender half of `close`: free the channel's buckets."""
        _STAGED.pop(channel_id, None)

    def close(self) -> None:
        """Drop the engine's mappings, then free the sender's buckets (in that order: memory still mapped by
        the engine is freed only once the engine lets go of it)."""
        engine, source, self.engine, self.source = self.engine, self.source, None, None
        try:
            if engine is not None:
                engine.receive(CudaIpcTransport.forget, self.channel_id)
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            pass
        try:
            if source is not None:
                source.run_sender(CudaIpcTransport.release, self.channel_id, gather=False)
        except Exception:  # noqa: BLE001
            pass


def _open(handle, device_index: int) -> Tensor:
    rebuild, args = handle
    args = list(args)
    args[6] = device_index  # the storage's device, as this process numbers the (same, checked) GPU
    return rebuild(*args)
