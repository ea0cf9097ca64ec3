"""`cuda_ipc`: trainer and engine processes on one GPU; the engine copies straight out of the trainer's memory.

The sender half (next to the full weights: the standalone trainer, or each trainer rank that has an engine on
its GPU: `sync.base.send_beside`) keeps a `Staging`:
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

`Staging` and `Receiver` live in `sync/staging.py` (the `nccl` transport uses them too). Each push's phase
timings (sender: export, layout, stage, checksum, sync; engine: copy, verify or sync; the bridge as
`engine/call`) are in `last_push`.

Both processes must see the same physical GPU; the handle carries the device's UUID and the engine
refuses a handle from another device instead of reading the wrong memory.
"""

from __future__ import annotations

import itertools
import time
import uuid

import torch
from torch import Tensor

from . import register
from .base import SyncError, as_source, receive_beside, send_beside
from .staging import Phases, Receiver, Staging, layout_key, push_report

_STAGED: dict[str, Staging] = {}
"""Sender process: the persistent buckets of each channel."""
_OPENED: dict[str, Receiver] = {}
"""Engine process: the opened buckets of each channel."""
_LAYOUTS = itertools.count()


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


@register("cuda_ipc")
class CudaIpcTransport:
    def __init__(self, sync_spec, **_options) -> None:
        self.spec = sync_spec
        self.channel_id = f"rlspec-ipc-{uuid.uuid4().hex[:12]}"
        self.source = None
        self.engine = None
        self.last_push: dict = {}
        """The last push's timings (`push_report`)."""

    def connect(self, engine, weights=None) -> None:
        pass  # the buckets are laid out and exported on the first push

    def push(self, weights, engine) -> int:
        """Each engine copies from the sender half beside it: with several colocated trainer ranks every rank
        stages its own gathered copy on its GPU and the engine on that GPU opens it (`send_beside`)."""
        self.source, self.engine = as_source(weights), engine
        start = time.perf_counter()
        sent = send_beside(self.source, CudaIpcTransport.send,
                           {"id": self.channel_id, "bucket_mb": self.spec.bucket_mb, "verify": self.spec.verify})
        sent_at = time.perf_counter()
        received = receive_beside(engine, CudaIpcTransport.receive, sent)
        done = time.perf_counter()
        self.last_push = push_report(done - start, {"sender": (sent_at - start, sent), "engine": (done - sent_at, received)})
        return sum(part["bytes"] for part in sent)

    @staticmethod
    def send(named, payload) -> dict:
        """Sender half: refill the channel's buckets (laying them out and exporting their handles when the
        weights' layout is new), synchronise, and describe them."""
        phases = Phases()
        named = [(name, tensor.detach() if tensor.requires_grad else tensor) for name, tensor in named]
        phases.mark("export")
        off_gpu = next((t.device for _, t in named if not t.is_cuda), None)
        if off_gpu is not None:
            raise SyncError(f"sync.method=cuda_ipc: the trainer's weights are on {off_gpu}, not a GPU "
                            "(use hardware.device=cuda, or another sync.method)")
        channel = payload["id"]
        staging = _STAGED.get(channel)
        if staging is None or staging.key != layout_key(named, payload["bucket_mb"]):
            _STAGED.pop(channel, None)  # free the old buckets before allocating the new ones
            staging = Staging(named, payload["bucket_mb"], f"{channel}/{next(_LAYOUTS)}")
            staging.parts = [{"handle": _handle(flat), "entries": entries}
                             for flat, entries in zip(staging.flats, staging.entries)]
            _STAGED[channel] = staging
            phases.mark("layout")
        else:
            phases.mark("layout_check")
        staging.copy_in(named)
        phases.mark("stage")
        expected = staging.expected(named) if payload["verify"] else None
        phases.mark("checksum")
        device = named[0][1].device if named else torch.device("cuda", torch.cuda.current_device())
        torch.cuda.synchronize(device)  # the engine reads these bytes from another process
        expected = None if expected is None else expected.cpu()
        phases.mark("sync")
        return {"id": channel, "layout": staging.layout_id, "parts": staging.parts, "bytes": staging.nbytes,
                "expected": expected, "device_uuid": _device_uuid(device), "times": phases.times}

    @staticmethod
    def receive(engine, payload) -> dict:
        """Engine half: open the buckets if their layout is new, copy into the engine's weights, verify."""
        phases = Phases()
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
            phases.mark("layout")
        receiver.copy()
        phases.mark("copy")
        if payload["expected"] is not None:
            receiver.verify(payload["expected"])  # waits for the copies
            phases.mark("verify")
        else:
            torch.cuda.synchronize(device)  # the copies are done before the sender refills its buckets
            phases.mark("sync")
        return {"times": phases.times}

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
                send_beside(source, CudaIpcTransport.release, self.channel_id, gather=False)
        except Exception:  # noqa: BLE001
            pass


def _handle(flat: Tensor) -> dict:
    """The IPC handle of a flat CUDA bucket, as data (bytes and numbers, no callable): it travels over the
    serve bridge, whose server rebuilds the tensor with its own code (`_open`)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(flat)
    (_cls, size, stride, offset, _storage_cls, dtype, _device, handle, storage_bytes, storage_offset_bytes,
     _requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    return {"size": list(size), "stride": list(stride), "offset": offset, "dtype": dtype, "handle": handle,
            "storage_bytes": storage_bytes, "storage_offset_bytes": storage_offset_bytes,
            "ref_counter_handle": ref_counter_handle, "ref_counter_offset": ref_counter_offset,
            "event_handle": event_handle, "event_sync_required": event_sync_required}


def _open(handle: dict, device_index: int) -> Tensor:
    """Map a bucket from `_handle` on `device_index` (the storage's device as this process numbers the same,
    checked, GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(torch.Tensor, torch.Size(handle["size"]), tuple(handle["stride"]), handle["offset"],
                               torch.storage.TypedStorage, handle["dtype"], device_index, handle["handle"],
                               handle["storage_bytes"], handle["storage_offset_bytes"], False,
                               handle["ref_counter_handle"], handle["ref_counter_offset"], handle["event_handle"],
                               handle["event_sync_required"])
