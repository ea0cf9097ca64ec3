"""`cuda_ipc`: trainer and engine processes on one GPU; the engine copies straight out of the trainer's memory.

The sender half (next to the full weights: the standalone trainer, or trainer rank 0) flattens the weights
into buckets of at most `sync.bucket_mb` on the GPU and exports one CUDA IPC handle per bucket — not one
per tensor, which costs a handle open per tensor and was measured 4x slower in the seed system. Only the
handles and the bucket layouts travel (through Ray or the serve bridge). The engine opens each handle,
copies the tensors in by name on the device, synchronises, and verifies (`verify_written`). The sender
keeps its buckets alive until the engine is done and drops them in `release`, so no copy outlives a push.

Both processes must see the same physical GPU; the handle carries the device's UUID and the engine
refuses a handle from another device instead of reading the wrong memory.
"""

from __future__ import annotations

import uuid

import torch

from . import register
from .base import Bucket, SyncError, as_source, buckets, fingerprint, verify_written, write_weights

_HELD: dict[str, list[torch.Tensor]] = {}
"""Sender process: the exported buckets of the push in flight, by channel id."""


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


@register("cuda_ipc")
class CudaIpcTransport:
    def __init__(self, sync_spec, **_options) -> None:
        self.spec = sync_spec
        self.channel_id = f"rlspec-ipc-{uuid.uuid4().hex[:12]}"
        self.source = None

    def connect(self, engine, weights=None) -> None:
        pass  # nothing to set up: a handle is opened per push

    def push(self, weights, engine) -> int:
        self.source = as_source(weights)
        sent = self.source.run_sender(CudaIpcTransport.send, {"id": self.channel_id, "bucket_mb": self.spec.bucket_mb,
                                                               "verify": self.spec.verify})
        try:
            engine.receive(CudaIpcTransport.receive, sent)
        finally:
            self.source.run_sender(CudaIpcTransport.release, self.channel_id, gather=False)
        return sent["bytes"]

    @staticmethod
    def send(named, payload) -> dict:
        """Sender half: flat GPU buckets, one IPC handle each; the buckets stay referenced until `release`."""
        from torch.multiprocessing.reductions import reduce_tensor

        held, parts, expected, total = [], [], {}, 0
        for bucket in buckets(named, payload["bucket_mb"]):
            if not bucket.flat.is_cuda:
                raise SyncError(f"sync.method=cuda_ipc: the trainer's weights are on {bucket.flat.device}, not a GPU "
                                "(use hardware.device=cuda, or another sync.method)")
            if payload["verify"]:
                expected.update(fingerprint(bucket.unpack()))
            held.append(bucket.flat)
            parts.append({"handle": reduce_tensor(bucket.flat), "entries": bucket.entries})
            total += bucket.nbytes
        if held:
            torch.cuda.synchronize(held[0].device)  # the engine reads these bytes from another process
        _HELD[payload["id"]] = held
        device = held[0].device if held else torch.device("cuda", torch.cuda.current_device())
        return {"parts": parts, "expected": expected or None, "bytes": total, "device_uuid": _device_uuid(device)}

    @staticmethod
    def receive(engine, payload) -> None:
        """Engine half: open each handle, copy by name on the device, verify."""
        device = torch.device(getattr(engine, "device", "cpu"))
        if device.type != "cuda":
            raise SyncError(f"sync.method=cuda_ipc: the engine runs on {device}, not on the trainer's GPU")
        if _device_uuid(device) != payload["device_uuid"]:
            raise SyncError(f"sync.method=cuda_ipc: the engine's GPU ({_device_uuid(device)}) is not the trainer's "
                            f"({payload['device_uuid']}); cuda_ipc needs both on one GPU (use sync.method=nccl)")
        index = device.index if device.index is not None else torch.cuda.current_device()
        written: list[str] = []
        for part in payload["parts"]:
            rebuild, args = part["handle"]
            args = list(args)
            args[6] = index  # the storage's device, as this process numbers the (same, checked above) GPU
            flat = rebuild(*args)
            write_weights(engine, Bucket(flat, [tuple(e) for e in part["entries"]]).unpack(), written)
            del flat
        torch.cuda.synchronize(device)  # the copies are done before the sender may free its buckets
        verify_written(engine, written, payload["expected"])

    @staticmethod
    def release(_named, channel_id) -> None:
        _HELD.pop(channel_id, None)

    def close(self) -> None:
        if self.source is not None:
            try:
                self.source.run_sender(CudaIpcTransport.release, self.channel_id, gather=False)
            except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
                pass
            self.source = None
