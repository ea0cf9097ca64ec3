"""`nccl`: a dedicated process group between trainer rank 0 and the engine(s); weights are broadcast.

The group is created eagerly in `connect`, while every party is known to be alive: trainer rank 0 hosts
a TCPStore, every engine joins it, the group is built (NCCL on CUDA, gloo on CPU, so the same code is
tested on CPU) and one warm-up broadcast forces the communicator into existence. The seed system created
it lazily on the first broadcast and hung when a party was late; here every wait is bounded by
`sync.timeout_s` and raises `SyncError`.

A push runs the two halves concurrently: trainer rank 0 (next to the gathered weights) publishes each
flat bucket's layout in the store and broadcasts the bucket; each engine reads the layout, allocates,
receives and copies in by name. The last store entry carries the sender's fingerprints, so the engine
verifies the whole sync (`verify_written`) before its half returns. The driver waits on both with a deadline.

The group lives in the processes that joined it (`_CHANNELS`, keyed by channel id and rank), because it
must outlive the call that created it; `close` drops it on both sides.
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch

from . import register
from .base import Bucket, SyncError, as_source, buckets, fingerprint, verify_written, write_weights

FAILURE_GRACE_S = 3.0
"""After one half of a transfer fails, how long to wait for the other half's account of it."""
_CHANNELS: dict[tuple[str, int], "_Channel"] = {}


@dataclass
class _Channel:
    store: object
    group: object
    device: torch.device
    timeout_s: float

    def broadcast(self, tensor: torch.Tensor) -> None:
        try:
            work = self.group.broadcast([tensor], _broadcast_opts(0))
            work.wait(timedelta(seconds=self.timeout_s))
        except Exception as err:  # noqa: BLE001 - any transport failure becomes a SyncError
            raise SyncError(f"broadcast failed or exceeded sync.timeout_s={self.timeout_s}: {err}") from err


def _broadcast_opts(root: int):
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return opts


def _join(payload: dict, rank: int, device: torch.device) -> None:
    """Build this process's end of the group (rank 0 hosts the store) and run the warm-up broadcast."""
    import torch.distributed as dist

    timeout = timedelta(seconds=payload["timeout_s"])
    try:
        store = dist.TCPStore(payload["host"], payload["port"], payload["world"], is_master=rank == 0,
                              timeout=timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(payload["id"], store)
        if payload["backend"] == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, payload["world"], opts)
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, payload["world"], timeout)
    except Exception as err:  # noqa: BLE001
        raise SyncError(f"sync.method=nccl: rendezvous of {payload['world']} parties at {payload['host']}:{payload['port']} "
                        f"failed or exceeded sync.timeout_s={payload['timeout_s']}: {err}") from err
    channel = _Channel(store, group, device, payload["timeout_s"])
    channel.broadcast(torch.zeros(1, device=device))  # creates the communicator now, not on the first push
    _CHANNELS[(payload["id"], rank)] = channel


@register("nccl")
class CollectiveTransport:
    def __init__(self, sync_spec, **_options) -> None:
        self.spec = sync_spec
        self.source = None
        self.engine = None
        self.channel_id: str | None = None
        self.version = 0

    def connect(self, engine, weights=None) -> None:
        if weights is None:
            raise SyncError("sync.method=nccl: connect(engine, weights) needs the weight source, because trainer "
                            "rank 0 is a member of the communicator (pass backend.weight_source())")
        self.source, self.engine = as_source(weights), engine
        host, port, device_type = self.source.run_sender(CollectiveTransport.address, None, gather=False)
        self.channel_id = f"rlspec-sync-{uuid.uuid4().hex[:12]}"
        payload = {"id": self.channel_id, "host": host, "port": port, "world": 1 + getattr(engine, "num_engines", 1),
                   "timeout_s": self.spec.timeout_s, "backend": "nccl" if device_type == "cuda" else "gloo"}
        try:
            self._both(CollectiveTransport.join_sender, payload, CollectiveTransport.join_receiver, payload, gather=False)
        except SyncError as err:
            raise SyncError(f"{err} [peer: {getattr(engine, 'label', type(engine).__name__)}]") from None

    def push(self, weights, engine) -> int:
        if self.channel_id is None:
            raise SyncError("sync.method=nccl: push before connect")
        self.version += 1
        payload = {"id": self.channel_id, "version": self.version, "bucket_mb": self.spec.bucket_mb,
                   "verify": self.spec.verify}
        sent, _ = self._both(CollectiveTransport.send, payload, CollectiveTransport.receive, payload, gather=True,
                             source=as_source(weights), engine=engine)
        return sent["bytes"]

    def _both(self, send_fn, send_payload, recv_fn, recv_payload, gather: bool, source=None, engine=None,
              timeout_s: float | None = None):
        """Run the sender and receiver halves concurrently; raise the first failure, or `SyncError` at the deadline."""
        source, engine = source or self.source, engine or self.engine
        results: dict[str, object] = {}
        failed = threading.Event()

        def run(key, fn, *args):
            try:
                results[key] = fn(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the driver thread
                results[key + "_error"] = err
                failed.set()

        threads = [threading.Thread(target=run, args=("sent", source.run_sender, send_fn, send_payload, gather), daemon=True),
                   threading.Thread(target=run, args=("received", engine.receive, recv_fn, recv_payload), daemon=True)]
        for thread in threads:
            thread.start()
        deadline = (timeout_s or self.spec.timeout_s) + 5.0
        waited = 0.0
        while any(t.is_alive() for t in threads) and not failed.is_set() and waited < deadline:
            threads[0].join(0.1) if threads[0].is_alive() else threads[1].join(0.1)
            waited += 0.1
        if failed.is_set():
            # One half failing usually makes the other fail too (a dead peer closes the connection): give it a
            # moment, so the error names both sides — the engine side's account says which peer died and how.
            for thread in threads:
                thread.join(FAILURE_GRACE_S)
            errors = [results[k] for k in ("received_error", "sent_error") if k in results]
            if len(errors) == 2:
                raise SyncError(f"sync.method=nccl failed on both sides: engine side: {errors[0]}; "
                                f"trainer side: {errors[1]}") from errors[1]
            raise errors[0]  # type: ignore[misc]
        if any(t.is_alive() for t in threads):
            raise SyncError(f"sync.method=nccl: transfer did not finish within sync.timeout_s={self.spec.timeout_s}")
        return results["sent"], results["received"]

    @staticmethod
    def address(_named, _payload) -> tuple[str, int, str]:
        from rlspec.ray_utils import node_address

        host, port = node_address()
        return host, port, "cuda" if torch.cuda.is_available() else "cpu"

    @staticmethod
    def join_sender(_named, payload) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if payload["backend"] == "nccl" else torch.device("cpu")
        _join(payload, 0, device)

    @staticmethod
    def join_receiver(engine, payload) -> None:
        device = engine.device if payload["backend"] == "nccl" else torch.device("cpu")
        _join(payload, 1 + getattr(engine, "engine_index", 0), device)

    @staticmethod
    def send(named, payload) -> dict:
        channel = _CHANNELS[(payload["id"], 0)]
        expected, total, i = {}, 0, 0
        for i, bucket in enumerate(buckets(named, payload["bucket_mb"])):
            channel.store.set(f"{payload['version']}/{i}", json.dumps(bucket.meta()))
            channel.broadcast(bucket.flat.to(channel.device))
            if payload["verify"]:
                expected.update(fingerprint(bucket.unpack()))
            total += bucket.nbytes
            i += 1
        channel.store.set(f"{payload['version']}/{i}", json.dumps({"end": True, "expected": expected or None}))
        return {"bytes": total}

    @staticmethod
    def receive(engine, payload) -> None:
        channel = _CHANNELS[(payload["id"], 1 + getattr(engine, "engine_index", 0))]
        i, written = 0, []
        while True:
            try:
                raw = channel.store.get(f"{payload['version']}/{i}")
            except Exception as err:  # noqa: BLE001 - the store raises on its timeout
                raise SyncError(f"sync.method=nccl: no bucket {i} from trainer rank 0 within sync.timeout_s="
                                f"{channel.timeout_s}: {err}") from err
            meta = json.loads(bytes(raw))
            if meta.get("end"):
                if channel.device.type == "cuda":
                    torch.cuda.synchronize(channel.device)  # the weights are in place when the push returns
                verify_written(engine, written, meta["expected"])
                return
            bucket = Bucket.empty_like_meta(meta, channel.device)
            channel.broadcast(bucket.flat)
            write_weights(engine, bucket.unpack(), written)
            i += 1

    @staticmethod
    def leave(_target, channel_id) -> None:
        for key in [k for k in _CHANNELS if k[0] == channel_id]:
            del _CHANNELS[key]

    def close(self) -> None:
        """Drop the group on both sides; best effort and bounded (a party may already be gone)."""
        if self.channel_id is None:
            return
        channel_id, self.channel_id = self.channel_id, None
        try:
            self._both(CollectiveTransport.leave, channel_id, CollectiveTransport.leave, channel_id, gather=False,
                       timeout_s=5.0)
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            pass
