"""The `nccl` transport on gloo, with both halves in this process (no Ray): a push, and a bounded rendezvous."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rlspec.models.factory import load_model, load_tokenizer
from rlspec.rollout.hf import HFEngine
from rlspec.spec.schema import ModelSpec, RolloutSpec, SyncSpec
from rlspec.sync import LocalWeights, SyncError, build_transport


def _engine(seed: int) -> HFEngine:
    spec = ModelSpec()
    return HFEngine(load_model(spec, seed), load_tokenizer(spec), RolloutSpec(), "cpu")


def test_push_moves_weights_and_verifies():
    trainer = load_model(ModelSpec(), 0)
    engine = _engine(1)
    transport = build_transport("nccl", SyncSpec(method="nccl", bucket_mb=1, timeout_s=20))
    source = LocalWeights(lambda: trainer.state_dict().items())
    try:
        transport.connect(engine, source)
        for _ in range(2):  # a second version over the same group
            with torch.no_grad():
                trainer.lm_head.weight.add_(0.01)
            assert transport.push(source, engine) > 0
            for name, tensor in engine.model.state_dict().items():
                assert torch.equal(tensor, trainer.state_dict()[name]), name
    finally:
        transport.close()
        transport.close()


class _AbsentEngine:
    """An engine that never joins the group (a dead or late peer)."""

    num_engines = 1

    def receive(self, fn, payload) -> None:
        time.sleep(0.1)


def test_rendezvous_times_out_instead_of_hanging():
    transport = build_transport("nccl", SyncSpec(method="nccl", timeout_s=2))
    start = time.monotonic()
    with pytest.raises(SyncError, match="timeout_s=2"):
        transport.connect(_AbsentEngine(), LocalWeights(lambda: iter(())))
    assert time.monotonic() - start < 10


def test_connect_without_weight_source_is_refused():
    with pytest.raises(SyncError, match="weight source"):
        build_transport("nccl", SyncSpec(method="nccl")).connect(_AbsentEngine())


class _Streamed:
    """A weight source that is not in this process's hands (as a sharded trainer's): the streamed path."""

    def __init__(self, export) -> None:
        self.export = export

    def run_sender(self, fn, payload, gather: bool = True):
        return fn((item for item in self.export()) if gather else None, payload)


def _source(kind: str, export):
    return LocalWeights(export) if kind == "local" else _Streamed(export)


def _same(engine, trainer) -> None:
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, trainer.state_dict()[name]), name


@pytest.mark.parametrize("kind", ["local", "streamed"])
def test_layout_changes_between_pushes_are_followed(kind):
    from dataclasses import replace

    trainer = load_model(ModelSpec(), 0)
    engine = _engine(1)
    spec = SyncSpec(method="nccl", bucket_mb=1, timeout_s=20)
    transport = build_transport("nccl", spec)
    everything = _source(kind, lambda: trainer.state_dict().items())
    one_alias = _source(kind, lambda: ((n, t) for n, t in trainer.state_dict().items() if n != "lm_head.weight"))
    try:
        transport.connect(engine, everything)
        for source, bucket_mb in ((everything, 1), (everything, 1), (one_alias, 1), (one_alias, 2), (everything, 2)):
            transport.spec = replace(spec, bucket_mb=bucket_mb)
            with torch.no_grad():
                trainer.model.norm.weight.add_(0.5)
                trainer.model.embed_tokens.weight.add_(0.25)  # tied: lm_head follows
            transport.push(source, engine)
            _same(engine, trainer)
        report = transport.last_push
        assert report["total_s"] > 0 and report["engine/call"] >= 0 and report["sender/call"] >= 0
        assert {"sender/broadcast", "sender/checksum", "engine/broadcast", "engine/copy"} <= set(report)
    finally:
        transport.close()


@pytest.mark.parametrize("kind", ["local", "streamed"])
def test_a_refused_mapping_names_the_tensor_and_leaves_the_channel_usable(kind):
    trainer = load_model(ModelSpec(), 0)
    engine = _engine(1)
    transport = build_transport("nccl", SyncSpec(method="nccl", bucket_mb=1, timeout_s=20))
    good = _source(kind, lambda: trainer.state_dict().items())
    missing = _source(kind, lambda: ((n, t) for n, t in trainer.state_dict().items() if n != "model.norm.weight"))
    renamed = _source(kind, lambda: (("model.norm.weights" if n == "model.norm.weight" else n, t)
                                     for n, t in trainer.state_dict().items()))
    try:
        transport.connect(engine, good)
        start = time.monotonic()
        with pytest.raises(SyncError, match=r"1 engine weight\(s\) never written: model\.norm\.weight"):
            transport.push(missing, engine)
        with pytest.raises(SyncError, match=r"does not have: model\.norm\.weights"):
            transport.push(renamed, engine)
        assert time.monotonic() - start < 10  # both halves finished: no side waited for its timeout
        transport.push(good, engine)  # the group is still in step
        _same(engine, trainer)
    finally:
        transport.close()


def test_verification_names_a_weight_whose_bytes_went_astray(monkeypatch):
    from rlspec.sync.staging import Receiver

    trainer = load_model(ModelSpec(), 0)
    engine = _engine(1)
    transport = build_transport("nccl", SyncSpec(method="nccl", bucket_mb=1, timeout_s=20))
    source = LocalWeights(lambda: trainer.state_dict().items())
    copy = Receiver.copy

    def astray(self, bucket=None):
        copy(self, bucket)
        with torch.no_grad():
            engine.model.model.norm.weight[3] += 1.0

    try:
        transport.connect(engine, source)
        transport.push(source, engine)
        monkeypatch.setattr(Receiver, "copy", astray)
        with pytest.raises(SyncError, match=r"differ after sync: model\.norm\.weight"):
            transport.push(source, engine)
        transport.spec = SyncSpec(method="nccl", bucket_mb=1, timeout_s=20, verify=False)
        transport.push(source, engine)  # unverified: not noticed, and no checksum is computed
        assert "engine/checksum" not in transport.last_push
    finally:
        transport.close()


class _ServedLike:
    """An engine behind a rollout server's engine thread whose bridge call for a push arrives only after the
    trainer's half of that push has finished: only the server's listener can have started the engine half."""

    num_engines = 1

    def __init__(self, engine, sent: threading.Event) -> None:
        from rlspec.serve.scheduler import Scheduler

        self.engine, self.sent = engine, sent
        self.thread = Scheduler(engine, None, max_queued_rows=1)  # a rollout server's engine thread

    def receive(self, fn, payload):
        from rlspec.sync.collective import CollectiveTransport

        if fn is CollectiveTransport.receive:
            assert self.sent.wait(20), "the trainer's half of the push waited for the bridge call"
            self.sent.clear()
        return self.thread.run(fn, self.engine, payload)


def test_a_servers_listener_runs_the_push_before_the_bridge_call_arrives():
    trainer = load_model(ModelSpec(), 0)
    sent = threading.Event()

    class Signalling(LocalWeights):
        def run_sender(self, fn, payload, gather=True):
            result = super().run_sender(fn, payload, gather)
            if gather:
                sent.set()
            return result

    served = _ServedLike(_engine(1), sent)
    transport = build_transport("nccl", SyncSpec(method="nccl", bucket_mb=1, timeout_s=20))
    source = Signalling(lambda: trainer.state_dict().items())
    try:
        transport.connect(served, source)
        for _ in range(3):
            with torch.no_grad():
                trainer.lm_head.weight.add_(0.01)
            transport.push(source, served)
            _same(served.engine, trainer)
    finally:
        transport.close()
    deadline = time.monotonic() + 10
    while any(t.name == "rlspec-sync-listener" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "rlspec-sync-listener" for t in threading.enumerate()), "close left the listener running"


class _CountingStore:
    """A store that counts the keys set and read (the push's round trips)."""

    def __init__(self, store, calls: list) -> None:
        self.store, self.calls = store, calls

    def set(self, key, value):
        self.calls.append(("set", key))
        return self.store.set(key, value)

    def get(self, key):
        self.calls.append(("get", key))
        return self.store.get(key)


def test_a_streamed_push_of_a_known_layout_makes_no_store_round_trip_and_still_verifies(monkeypatch):
    """The split layout's push from a sharded trainer (`sync.streamed`): the first push describes its buckets in the
    store, the next ones (same layout) send them in band only; the weights arrive exact, and verification still
    names a weight whose bytes went astray in the engine's copy."""
    from rlspec.sync import collective, streamed

    trainer = load_model(ModelSpec(), 0)
    engine = _engine(1)
    transport = build_transport("nccl", SyncSpec(method="nccl", bucket_mb=1, timeout_s=20))
    source = _Streamed(lambda: trainer.state_dict().items())
    calls: list = []
    try:
        transport.connect(engine, source)
        for (key, rank), channel in list(collective._CHANNELS.items()):
            if key == transport.channel_id:
                channel.store = _CountingStore(channel.store, calls)
        transport.push(source, engine)
        first = len(calls)
        assert first >= 2, calls  # each new bucket's description: set by the sender, read by the engine
        with torch.no_grad():
            trainer.model.norm.weight.add_(0.5)
        transport.push(source, engine)
        _same(engine, trainer)
        assert len(calls) == first, calls[first:]
        copy_in = streamed._copy_in

        def astray(channel, lookup, bucket, work):
            names = copy_in(channel, lookup, bucket, work)
            if "model.norm.weight" in names:
                with torch.no_grad():
                    engine.model.model.norm.weight[3] += 1.0
            return names

        monkeypatch.setattr(streamed, "_copy_in", astray)
        with pytest.raises(SyncError, match=r"differ after sync: model\.norm\.weight"):
            transport.push(source, engine)
        monkeypatch.setattr(streamed, "_copy_in", copy_in)
        transport.push(source, engine)  # the group is still in step
        _same(engine, trainer)
    finally:
        transport.close()


def test_a_listener_that_reads_a_header_late_leaves_the_labelled_weights_alone():
    """A rollout server's listener may read a push's header after the trainer's bridge call already ran that push
    and labelled the weights (a loaded host): its queued job must then run nothing and leave the label, where it
    used to mark the weights unknown (a joined server reported `weight_version` null after a finished run). A push
    the bridge call has not run still runs, and leaves the weights unlabelled until the trainer labels them."""
    import asyncio

    from rlspec.serve.app import EngineHost
    from rlspec.sync.collective import _Channel, queue_listened

    host = EngineHost(_engine(1), "tiny")
    channel = _Channel(None, None, torch.device("cpu"), 1.0)
    ran = []
    assert host.thread.run(channel.run_called, 3, lambda: "pushed") == "pushed"  # the bridge call ran push 3
    asyncio.run(host.label(3))
    queue_listened(host.thread.submit, channel, 3, lambda: ran.append(3))  # its header, read late
    host.thread.run(lambda: None)  # jobs run in order: the listener's has run
    assert ran == [] and host.weight_version == 3
    queue_listened(host.thread.submit, channel, 4, lambda: ran.append(4))  # the next push, read in time
    host.thread.run(lambda: None)
    assert ran == [4] and host.weight_version is None and channel.outcomes[4] == (True, None)
