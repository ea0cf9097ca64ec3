"""`nccl`: a dedicated process group between trainer rank 0 and the engine(s); weights are broadcast.

The group is created eagerly in `connect`, while every party is known to be alive: trainer rank 0 hosts
a TCPStore, every engine joins it, the group is built (NCCL on CUDA, gloo on CPU, so the same code is
tested on CPU) and one warm-up broadcast forces the communicator into existence. The seed system created
it lazily on the first broadcast and hung when a party was late; here every wait is bounded by
`sync.timeout_s` and raises `SyncError`.

A push runs the two halves concurrently, and most of what they need is kept per channel (`sync.staging`):

- The sender (trainer rank 0, next to the gathered weights) compares the export's names, shapes and dtypes
  with the last push's. On a new layout it plans the buckets and writes the layout's description to the
  store once; every push then writes only the layout's id (one store round trip), copies bucket after bucket
  into two reused buffers (one fused copy each) and broadcasts it, bucket b+1 being copied while bucket b is
  on the wire. With `sync.verify` it also broadcasts one int32 byte checksum per tensor, taken from the
  staged bytes on the device.
- Each engine reads the id; on a new layout it reads the description, checks the name mapping once (each
  engine weight written exactly once, no unknown name, same shapes: `Receiver`) and keeps where each entry
  lands. Then it receives bucket after bucket into two reused buffers, copying each into the engine's weights
  (one fused copy) while the next one arrives. With `sync.verify` it compares the received checksums with
  those of its own weights on the device, with one host sync; a refused mapping still takes part in the
  push's broadcasts, so the group stays in step.

That cached-layout path is for an in-process source (`LocalWeights`: the standalone trainer), whose export
is the model's own tensors. A sharded trainer's export gathers a group at a time, and holding all of it to
lay it out would put the whole model on rank 0: there each bucket is sent as it fills, after a one-word code in
band that says whether it is laid out as the previous push's bucket (no store round trip) or has a new description
in the store; the sender packs the next bucket while this one is on the wire, the engine copies the previous one
in by name meanwhile, and the name mapping and byte checksums are checked at the end (`sync.streamed`).

In a rollout server the engine half does not wait for the trainer's bridge call (HTTP, then a hand-off to the
engine thread: about 1.3 ms on an H200 host) to start: a listener thread reads each push's header from the
store as it lands and queues the engine half on the engine thread; the bridge call collects the outcome
(`_Channel.run_listened` / `run_called`: whichever reaches the engine thread first runs the push, once).

On CUDA nothing waits on the host between buckets (the copies and broadcasts are ordered by streams); each
half ends with one bounded wait. A push's phase timings are in `last_push` (see `staging.push_report`).
The driver waits on both halves with a deadline.

The group lives in the processes that joined it (`_CHANNELS`, keyed by channel id and rank), because it
must outlive the call that created it; `close` drops it on both sides.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from . import register, streamed
from .base import LocalWeights, SyncError, as_source, engine_thread_submit
from .staging import Phases, Receiver, Staging, flat_buffers, layout_key, push_report

SLOTS = 2
"""Bucket buffers per side: bucket b+1 is copied while bucket b is on the wire; a side holds 2 x sync.bucket_mb."""
POLL_S = 5e-5
"""Sleep between polls of a CUDA event that ends a push's half."""
FAILURE_GRACE_S = 3.0
"""After one half of a transfer fails, how long to wait for the other half's account of it."""
LISTEN_TIMEOUT = timedelta(days=1)
"""How long one wait of a rollout server's listener for the next push header lasts (it then waits again)."""
KEPT_OUTCOMES = 4
"""Outcomes of listener-run pushes kept for a bridge call that has not come (yet)."""
_CHANNELS: dict[tuple[str, int], "_Channel"] = {}


@dataclass
class _Channel:
    store: object
    group: object
    device: torch.device
    timeout_s: float
    staging: Staging | None = None
    """Sender (rank 0): the current layout's buckets."""
    receiver: Receiver | None = None
    """Engine ranks: the current layout's buckets and where each entry lands."""
    layouts: int = 0
    latest: int = 0
    """Engine ranks: the newest push whose engine half has started here."""
    outcomes: dict = field(default_factory=dict)
    """Engine ranks in a rollout server: push version -> (ok, result or error) of an engine half the listener
    ran, until the trainer's bridge call collects it."""
    closed: bool = False
    stream_metas: list = field(default_factory=list)
    """Both sides of a streamed push (`sync.streamed`): the last push's bucket descriptions."""
    stream_codes: object = None
    """Sender of a streamed push: its code words on the device."""
    stream_side: object = None
    """Engine of a streamed push on CUDA: the side stream and pinned word its codes are read through."""

    def run_listened(self, version: int, work) -> None:
        """The listener's job: run push `version`'s engine half unless the bridge call already has, and keep its
        outcome for the bridge call (a failure is raised too, so the server marks its weights unknown)."""
        if version <= self.latest:
            return
        self.latest = version
        try:
            outcome = (True, work())
        except BaseException as err:  # noqa: BLE001 - handed to the bridge call
            outcome = (False, err)
        self.outcomes[version] = outcome
        for old in [v for v in self.outcomes if v <= version - KEPT_OUTCOMES]:
            del self.outcomes[old]
        if not outcome[0]:
            raise outcome[1]

    def run_called(self, version: int, work):
        """The trainer's bridge call for push `version`: the listener's outcome, or `work()` run now."""
        if version in self.outcomes:
            ok, value = self.outcomes.pop(version)
            if ok:
                return value
            raise value
        if version <= self.latest:
            raise SyncError(f"sync.method=nccl: push {version} already ran on this engine and its outcome is gone")
        self.latest = version
        return work()

    def get(self, key: str, what: str) -> bytes:
        """`key` of the store (what rank 0 wrote), or a SyncError naming `what` at the store's timeout."""
        try:
            return bytes(self.store.get(key))
        except Exception as err:  # noqa: BLE001 - the store raises on its timeout
            raise SyncError(f"sync.method=nccl: no {what} from trainer rank 0 within sync.timeout_s={self.timeout_s}: "
                            f"{err}") from err

    def start(self, tensor: torch.Tensor):
        """Enqueue a broadcast from rank 0 (on CUDA it runs on the group's stream; nothing waits here)."""
        try:
            return self.group.broadcast([tensor], _broadcast_opts(0))
        except Exception as err:  # noqa: BLE001 - any transport failure becomes a SyncError
            raise SyncError(f"broadcast failed: {err}") from err

    def after(self, work) -> None:
        """What comes next runs after `work`: on CUDA the current stream waits for it (no host wait), on CPU this
        thread does (bounded)."""
        if self.device.type == "cuda":
            work.wait()
        else:
            self.wait(work)

    def wait(self, work) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except Exception as err:  # noqa: BLE001
            raise SyncError(f"broadcast failed or exceeded sync.timeout_s={self.timeout_s}: {err}") from err

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.wait(self.start(tensor))

    def finish(self, works: list) -> None:
        """Wait, on the host and at most `sync.timeout_s`, until `works` and everything enqueued before on the
        current stream are done. On CUDA that is one event polled with short sleeps: `work.wait(timeout)` would
        poll at a coarser step per bucket."""
        for work in works:
            self.after(work)
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + self.timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                raise SyncError(f"broadcast did not complete within sync.timeout_s={self.timeout_s}")
            time.sleep(POLL_S)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _broadcast_opts(root: int):
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return opts


def _join(payload: dict, rank: int, device: torch.device) -> _Channel:
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
    channel = _Channel(dist.PrefixStore(f"{payload['id']}/sync", store), group, device, payload["timeout_s"])
    channel.broadcast(torch.zeros(1, device=device))  # creates the communicator now, not on the first push
    _CHANNELS[(payload["id"], rank)] = channel
    return channel


def _listen(channel: _Channel, engine, payload: dict, submit) -> None:
    """In a rollout server: wait for each push's header and queue its engine half on the engine thread at once,
    so the engine posts its receives while the trainer's bridge call is still on its way (that call then
    collects the outcome).

    It has its own store connection, because a store client runs one call at a time and this one blocks (with
    no timeout: a store timeout logs a warning each time, and pushes may be hours apart). It ends at the close
    marker that `close` writes as the next header, or when the trainer's store is gone; a push it misses (its
    header never came) is run by the bridge call itself, as on a Ray engine."""
    import torch.distributed as dist

    try:
        client = dist.TCPStore(payload["host"], payload["port"], payload["world"], is_master=False,
                               timeout=LISTEN_TIMEOUT, wait_for_workers=False)
    except Exception:  # noqa: BLE001 - the bridge calls run every push without it
        return
    store = dist.PrefixStore(f"{payload['id']}/sync", client)
    version = channel.latest + 1
    while not channel.closed:
        version = max(version, channel.latest + 1)
        try:
            header = bytes(store.get(f"push/{version}"))
        except dist.DistStoreError:  # waited LISTEN_TIMEOUT: wait again
            continue
        except Exception:  # noqa: BLE001 - the store's host (trainer rank 0) is gone
            return
        if channel.closed or json.loads(header).get("close"):
            return
        queue_listened(submit, channel, version, lambda v=version, h=header: _receive(engine, channel, v, h))
        version += 1


def queue_listened(submit, channel: _Channel, version: int, work) -> None:
    """Queue push `version`'s engine half on the engine thread (`submit`), due only while the bridge call has not
    run it: a listener that reads a header late (a loaded host) must not mark the server's weights unknown after
    the trainer labelled them."""
    submit(channel.run_listened, version, work, due=lambda: version > channel.latest)


def _drain(channel: _Channel, flats: list[torch.Tensor], num_entries: int, verify: bool) -> None:
    """Take part in a push's broadcasts without using them (the engine refused the layout), so sender and
    engines stay in step."""
    works = [channel.start(flat) for flat in flats]
    if verify:
        works.append(channel.start(torch.empty(num_entries, dtype=torch.int32, device=channel.device)))
    channel.finish(works)


def _receive(engine, channel: _Channel, version: int, header: bytes | None) -> dict:
    """Engine half of a push: learn its layout (the description only when new), receive bucket after bucket,
    copying each into the engine's weights while the next one arrives, then verify. `header` is the push's
    store entry when the listener already read it."""
    phases = Phases()
    if header is None:
        header = channel.get(f"push/{version}", "push header")
    head = json.loads(header)
    layout_id, verify = head["layout"], head["verify"]
    phases.mark("wait_sender")
    receiver = channel.receiver
    if receiver is None or receiver.layout_id != layout_id or receiver.engine() is not engine:
        channel.receiver = None
        layout = json.loads(channel.get(f"layout/{layout_id}", "layout"))
        flats = flat_buffers([(getattr(torch, b["dtype"]), b["numel"]) for b in layout], channel.device, SLOTS)
        try:
            receiver = Receiver(engine, flats, [b["entries"] for b in layout], layout_id)
        except SyncError:
            _drain(channel, flats, sum(len(b["entries"]) for b in layout), verify)
            raise  # after the group is back in step, so the next push can use it
        receiver.expected = torch.empty(len(receiver.names), dtype=torch.int32, device=channel.device)
        channel.receiver = receiver
        phases.mark("layout")
    works, sums = [], []
    for b, flat in enumerate(receiver.flats):
        works.append(channel.start(flat))  # reusing a buffer waits for the copy out of it (stream order)
        phases.mark("broadcast")
        channel.after(works[-1])
        phases.mark("arrive")
        receiver.copy(b)
        phases.mark("copy")
        if verify:  # while the next bucket is on the wire
            sums.append(receiver.checksums(b))
            phases.mark("checksum")
    actual = None
    if verify:
        works.append(channel.start(receiver.expected))
        actual = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.int32, device=channel.device)
    channel.finish(works)  # bounded: the weights are in place when the push returns
    phases.mark("wait")
    if actual is not None:
        receiver.verify(receiver.expected, actual)
        phases.mark("verify")
    return {"times": phases.times}


@register("nccl")
class CollectiveTransport:
    def __init__(self, sync_spec, **_options) -> None:
        self.spec = sync_spec
        self.source = None
        self.engine = None
        self.channel_id: str | None = None
        self.version = 0
        self.last_push: dict = {}
        """The last push's timings (`push_report`); the two halves overlap."""
        self._walls: dict[str, float] = {}

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
        source = as_source(weights)
        # An in-process source (standalone) hands over its own tensors: the cached-layout path. A sharded
        # trainer's export gathers a group at a time: streamed, so rank 0 holds one bucket, not the model.
        send, receive = ((CollectiveTransport.send, CollectiveTransport.receive) if isinstance(source, LocalWeights)
                         else (CollectiveTransport.send_streamed, CollectiveTransport.receive_streamed))
        start = time.perf_counter()
        sent, received = self._both(send, payload, receive, payload, gather=True, source=source, engine=engine)
        self.last_push = push_report(time.perf_counter() - start, {"sender": (self._walls["sent"], sent),
                                                                   "engine": (self._walls["received"], received)})
        return sent["bytes"]

    def _both(self, send_fn, send_payload, recv_fn, recv_payload, gather: bool, source=None, engine=None,
              timeout_s: float | None = None):
        """Run the sender and receiver halves concurrently; raise the first failure, or `SyncError` at the deadline."""
        source, engine = source or self.source, engine or self.engine
        results: dict[str, object] = {}
        failed = threading.Event()

        def run(key, fn, *args):
            start = time.perf_counter()
            try:
                results[key] = fn(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the driver thread
                results[key + "_error"] = err
                failed.set()
            self._walls[key] = time.perf_counter() - start

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
        from rlspec.cluster.ray_utils import node_address

        host, port = node_address()
        return host, port, "cuda" if torch.cuda.is_available() else "cpu"

    @staticmethod
    def join_sender(_named, payload) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if payload["backend"] == "nccl" else torch.device("cpu")
        _join(payload, 0, device)

    @staticmethod
    def join_receiver(engine, payload) -> None:
        device = engine.device if payload["backend"] == "nccl" else torch.device("cpu")
        channel = _join(payload, 1 + getattr(engine, "engine_index", 0), device)
        submit = engine_thread_submit()
        if submit is not None:  # a rollout server: start each push when its header lands, not when the call does
            threading.Thread(target=_listen, args=(channel, engine, payload, submit), name="rlspec-sync-listener",
                             daemon=True).start()

    @staticmethod
    @torch.no_grad()  # the staging copies read parameters: no autograd record, no per-tensor detach
    def send(named, payload) -> dict:
        """Sender half (trainer rank 0): stage and broadcast bucket after bucket, then the checksums."""
        channel = _CHANNELS[(payload["id"], 0)]
        phases = Phases()
        named = list(named)
        phases.mark("export")
        staging = channel.staging
        if staging is None or staging.key != layout_key(named, payload["bucket_mb"]):
            channel.staging = None  # free the old buckets first
            channel.layouts += 1
            staging = Staging(named, payload["bucket_mb"], str(channel.layouts), channel.device, SLOTS)
            channel.store.set(f"layout/{staging.layout_id}", json.dumps(staging.description))
            channel.staging = staging
            phases.mark("layout")
        else:
            phases.mark("layout_check")
        channel.store.set(f"push/{payload['version']}", json.dumps({"layout": staging.layout_id,
                                                                     "verify": payload["verify"]}))
        phases.mark("header")
        works, sums = [], []
        for b, flat in enumerate(staging.flats):
            if b >= SLOTS:
                channel.after(works[b - SLOTS])  # that bucket has left the buffer this one reuses
            staging.copy_in(named, b)
            phases.mark("stage")
            works.append(channel.start(flat))
            phases.mark("broadcast")
            if payload["verify"]:  # reads the bucket while it is on the wire
                sums.append(staging.expected(named, b))
                phases.mark("checksum")
        if payload["verify"]:
            works.append(channel.start(torch.cat(sums) if sums else torch.zeros(0, dtype=torch.int32, device=channel.device)))
        channel.finish(works)
        phases.mark("wait")
        return {"bytes": staging.nbytes, "times": phases.times}

    @staticmethod
    def receive(engine, payload) -> dict:
        """Engine half: the push's outcome (in a rollout server the listener may have run it already)."""
        channel = _CHANNELS[(payload["id"], 1 + getattr(engine, "engine_index", 0))]
        version = payload["version"]
        return channel.run_called(version, lambda: _receive(engine, channel, version, None))

    @staticmethod
    def send_streamed(named, payload) -> dict:
        """Sender half for a sharded trainer, whose export gathers a group at a time (`sync.streamed`)."""
        return streamed.send(_CHANNELS[(payload["id"], 0)], named, payload)

    @staticmethod
    def receive_streamed(engine, payload) -> dict:
        """Engine half of `send_streamed` (`sync.streamed`)."""
        return streamed.receive(_CHANNELS[(payload["id"], 1 + getattr(engine, "engine_index", 0))], engine, payload)

    @staticmethod
    def raw_send(_named, payload) -> list[float]:
        """Sender half of a raw broadcast of `payload["numel"]` bf16 elements, `repeats` + 1 times (the first waits
        for the peer): the seconds of each timed one. What `rlspec.perf.bench_sync` compares a push with."""
        channel = _CHANNELS[(payload["id"], 0)]
        buffer = torch.empty(payload["numel"], dtype=torch.bfloat16, device=channel.device)
        times = []
        for _ in range(payload["repeats"] + 1):
            _synchronize(channel.device)
            start = time.perf_counter()
            channel.broadcast(buffer)
            _synchronize(channel.device)
            times.append(time.perf_counter() - start)
        return times[1:]

    @staticmethod
    def raw_receive(_engine, payload) -> None:
        """Engine half of `raw_send` (in every engine of the group)."""
        channel = _CHANNELS[(payload["id"], 1 + getattr(_engine, "engine_index", 0))]
        buffer = torch.empty(payload["numel"], dtype=torch.bfloat16, device=channel.device)
        for _ in range(payload["repeats"] + 1):
            channel.broadcast(buffer)
            _synchronize(channel.device)

    @staticmethod
    def leave(_target, payload) -> None:
        """Drop this process's end of the channel; trainer rank 0 also writes the close marker as the next push
        header, which ends an engine's listener."""
        for key in [k for k in _CHANNELS if k[0] == payload["id"]]:
            channel = _CHANNELS.pop(key)
            channel.closed = True
            if key[1] == 0:
                try:
                    channel.store.set(f"push/{payload['next']}", json.dumps({"close": True}))
                except Exception:  # noqa: BLE001 - the peer may be gone; the store then closes with this process
                    pass

    def close(self) -> None:
        """Drop the group on both sides; best effort and bounded (a party may already be gone)."""
        if self.channel_id is None:
            return
        payload, self.channel_id = {"id": self.channel_id, "next": self.version + 1}, None
        try:
            self._both(CollectiveTransport.leave, payload, CollectiveTransport.leave, payload, gather=False,
                       timeout_s=5.0)
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            pass

