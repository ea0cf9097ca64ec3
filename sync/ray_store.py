"""`ray`: weights travel through the Ray object store; the engines pull them.

The sender half runs next to the weights (trainer rank 0 for a sharded trainer; in a colocated layout each
rank with an engine beside it, into its own node's store: `sync.base.send_beside`) and puts one flat
bucket of at most `sync.bucket_mb` per object; only the object references travel through the driver.
Every engine pulls the buckets (bounded by `sync.timeout_s`) and copies them in by name. No
communicator is involved, so nothing can hang on a rendezvous (the failure the seed system hit).
"""

from __future__ import annotations

from . import register
from .base import (Bucket, Fingerprints, SyncError, as_source, buckets, receive_beside, send_beside, verify_written,
                   write_weights)


@register("ray")
class RayStoreTransport:
    def __init__(self, sync_spec, **_options) -> None:
        self.spec = sync_spec

    def connect(self, engine, weights=None) -> None:
        import ray

        if not ray.is_initialized():
            raise SyncError("sync.method=ray needs Ray to be running in this process (the backend starts it)")

    def push(self, weights, engine) -> int:
        sent = send_beside(as_source(weights), RayStoreTransport.send,
                           {"bucket_mb": self.spec.bucket_mb, "verify": self.spec.verify})
        receive_beside(engine, RayStoreTransport.receive, [{**part, "timeout_s": self.spec.timeout_s} for part in sent])
        return sum(part["bytes"] for part in sent)

    @staticmethod
    def send(named, payload) -> dict:
        """Sender half: one object per bucket. Each reference is wrapped in a list so Ray passes it along
        unresolved; the objects live as long as the driver holds the references."""
        import ray

        parts, total, prints = [], 0, Fingerprints() if payload["verify"] else None
        # fingerprinted as the trainer holds them, before bucketing: a packing bug shows on the engine
        for bucket in buckets(prints.tap(named) if prints else named, payload["bucket_mb"]):
            parts.append({"meta": bucket.meta(), "ref": [ray.put(bucket.flat.cpu())]})
            total += bucket.nbytes
        return {"parts": parts, "expected": (prints.result() or None) if prints else None, "bytes": total}

    @staticmethod
    def receive(engine, payload) -> None:
        import ray

        refs = [part["ref"][0] for part in payload["parts"]]
        try:
            flats = ray.get(refs, timeout=payload["timeout_s"])
        except ray.exceptions.GetTimeoutError:
            raise SyncError(f"weights did not arrive from the object store within sync.timeout_s={payload['timeout_s']}") from None
        written: list[str] = []
        for part, flat in zip(payload["parts"], flats):
            bucket = Bucket(flat, [tuple(e) for e in part["meta"]["entries"]])
            write_weights(engine, bucket.unpack(), written)
        verify_written(engine, written, payload["expected"])

    def close(self) -> None:
        pass
