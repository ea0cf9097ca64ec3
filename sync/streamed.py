"""The `nccl` push from a sharded trainer, pipelined: bucket after bucket as the export gathers them, no host wait
and no store round trip per bucket while the layout holds.

A sharded trainer's export yields the full weights a group at a time, so rank 0 cannot lay the whole push out
before sending (that would hold the model). Each bucket is therefore sent as it fills, and the receiving engine
learns its shape from a one-word code broadcast in band just before it:

- `SAME`: the bucket is laid out as bucket b of the previous push (both sides keep the last push's bucket
  descriptions, `_Channel.stream_metas`), so nothing goes through the store;
- `NEW`: its description is in the store under `<version>/<b>` (the first push, or a layout that changed: another
  `sync.bucket_mb`, a renamed or missing tensor);
- `END`: no more buckets; with `sync.verify` one int32 byte checksum per tensor follows (taken by the sender from
  its tensors before bucketing, checked by the engine against its own weights after the copy).

The sender enqueues code and bucket and goes on packing the next one (at most `SLOTS` buckets in flight, so rank 0
holds about two buckets); on CUDA it never waits on the host until the push's end. The engine reads each code (on
CUDA from a side stream, so the read does not wait for the previous bucket's copy), starts receiving the bucket,
and copies the one before into its weights while this one is on the wire. The name mapping and checksums are
checked once at the end; a refused mapping still takes part in every broadcast, so the group stays in step.
"""

from __future__ import annotations

import json
import time
from collections import deque

import torch

from .base import Bucket, SyncError, buckets, check_mapping, checksums, compare_checksums
from .staging import Phases

SAME, NEW, END = 0, 1, 2
SLOTS = 2
"""Buckets the sender keeps in flight (it packs the next one meanwhile)."""
POLL_S = 5e-5


def send(channel, named, payload) -> dict:
    """Sender half (trainer rank 0): stream the export's buckets, each after its code; then the checksums."""
    phases = Phases()
    verify = payload["verify"]
    metas = channel.stream_metas
    codes = _codes(channel)
    tap = _Checksums(named if verify else ())
    order: list[str] = []
    in_flight: deque = deque()
    works = []
    total = count = 0
    with torch.no_grad():
        for b, bucket in enumerate(buckets(tap if verify else named, payload["bucket_mb"])):
            tap.flush()
            phases.mark("export")
            meta = bucket.meta()
            if b < len(metas) and metas[b] == meta:
                code = SAME
            else:
                code = NEW
                channel.store.set(f"{payload['version']}/{b}", json.dumps(meta))
                metas[b:b + 1] = [meta]
                phases.mark("header")
            flat = bucket.flat.to(channel.device)
            works.append(channel.start(codes[code:code + 1]))
            in_flight.append((channel.start(flat), flat))
            phases.mark("broadcast")
            while len(in_flight) > SLOTS:  # that bucket has left rank 0: its memory may be reused
                channel.after(in_flight.popleft()[0])
                phases.mark("wait")
            order += [name for name, *_ in bucket.entries]
            total += bucket.nbytes
            count = b + 1
        del metas[count:]
        works.append(channel.start(codes[END:END + 1]))
        if verify:  # enqueued as each tensor passed ("export"); broadcast without a host sync
            expected = torch.stack([tap.sums[name] for name in order]) if order else \
                torch.zeros(0, dtype=torch.int32, device=channel.device)
            works.append(channel.start(expected.to(channel.device)))
            phases.mark("checksum")
        channel.finish(works + [work for work, _ in in_flight])
        phases.mark("wait")
    return {"bytes": total, "buckets": count, "times": phases.times}


def receive(channel, engine, payload) -> dict:
    """Engine half: bucket after bucket, each copied in by name while the next one arrives; the name mapping and
    (with `sync.verify`) the byte checksums are checked at the end."""
    phases = Phases()
    own = list(engine.named_weights())
    lookup = dict(own)
    metas = channel.stream_metas
    code_buffer = torch.empty(1, dtype=torch.int32, device=channel.device)
    written: list[str] = []
    pending = None
    b = 0
    with torch.no_grad():
        while True:
            code = _read_code(channel, code_buffer)
            phases.mark("wait_sender")
            if code == END:
                break
            if code == NEW:
                metas[b:b + 1] = [json.loads(channel.get(f"{payload['version']}/{b}", f"bucket {b}"))]
                phases.mark("header")
            elif code != SAME or b >= len(metas):
                raise SyncError(f"sync.method=nccl: bucket {b} of push {payload['version']} has code {code} and no "
                                "description here: the two halves are out of step")
            bucket = Bucket.empty_like_meta(metas[b], channel.device)
            work = channel.start(bucket.flat)
            phases.mark("broadcast")
            if pending is not None:
                written += _copy_in(channel, lookup, *pending)
                phases.mark("copy")
            pending = (bucket, work)
            b += 1
        if pending is not None:
            written += _copy_in(channel, lookup, *pending)
            phases.mark("copy")
        del metas[b:]
        works = []
        if payload["verify"]:
            expected = torch.empty(len(written), dtype=torch.int32, device=channel.device)
            works.append(channel.start(expected))
        channel.finish(works)  # the weights are in place when the push returns
        phases.mark("wait")
        check_mapping(own, written)
        if payload["verify"]:
            # enqueued before the host waits; one launch on CUDA (the engine's tensors from `named_weights()` may
            # be new objects at every push, so no graph is kept of them)
            actual = checksums([lookup[name] for name in written])
            compare_checksums(written, expected.cpu(), actual)
            phases.mark("verify")
    return {"buckets": b, "times": phases.times}


def _copy_in(channel, lookup: dict, bucket: Bucket, work) -> list[str]:
    """Copy a received bucket into the engine's weights (one fused copy, after its broadcast); its names."""
    channel.after(work)
    pairs = [(lookup[name], tensor) for name, tensor in bucket.unpack() if name in lookup]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [t for _, t in pairs])
    return [name for name, *_ in bucket.entries]


def _codes(channel) -> torch.Tensor:
    """The sender's code words on its device, made once per channel."""
    if channel.stream_codes is None:
        channel.stream_codes = torch.arange(3, dtype=torch.int32, device=channel.device)
    return channel.stream_codes


def _read_code(channel, buffer: torch.Tensor) -> int:
    """Receive the next code word and read it on the host, bounded by `sync.timeout_s`. On CUDA the read waits
    for the code's broadcast only (a side stream), not for the copies enqueued on the current stream."""
    work = channel.start(buffer)
    if channel.device.type != "cuda":
        channel.wait(work)
        return int(buffer.item())
    if channel.stream_side is None:
        channel.stream_side = (torch.cuda.Stream(channel.device), torch.empty(1, dtype=torch.int32, pin_memory=True))
    side, host = channel.stream_side
    with torch.cuda.stream(side):
        work.wait()
        host.copy_(buffer, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    deadline = time.monotonic() + channel.timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise SyncError(f"sync.method=nccl: no bucket from trainer rank 0 within sync.timeout_s={channel.timeout_s}")
        time.sleep(POLL_S)
    return int(host.item())


class _Checksums:
    """`named` unchanged as it is iterated; `flush()` takes the byte checksums (`checksums`) of the tensors that
    passed since the last flush, in one call (one kernel on CUDA), into `sums` by name. Taken from the export's
    tensors as they come, before bucketing (for a gathered group the bucket is their buffer)."""

    def __init__(self, named) -> None:
        self.named = named
        self.pending: list[tuple[str, torch.Tensor]] = []
        self.sums: dict[str, torch.Tensor] = {}

    def __iter__(self):
        for name, tensor in self.named:
            self.pending.append((name, tensor))
            yield name, tensor

    def flush(self) -> None:
        if self.pending:
            values = checksums([tensor for _, tensor in self.pending])
            self.sums.update((name, values[i]) for i, (name, _) in enumerate(self.pending))
            self.pending = []
