"""`cuda_ipc` on one GPU (skipped without CUDA): a rollout server on the trainer's GPU receives the weights
through one IPC handle per persistent bucket, verified, across pushes and a layout change; a source missing
a tensor fails the sync naming it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def served():
    from rlspec.core.backend import all_caps
    from rlspec.models.factory import load_tokenizer
    from rlspec.serve.client import ServedEngine, ServerClient
    from rlspec.serve.process import ServerProcess
    from rlspec.spec import HardwareSpec, ModelSpec, Spec, SyncSpec, compile_plan

    spec = Spec(model=ModelSpec(dtype="bfloat16"), sync=SyncSpec(method="cuda_ipc", bucket_mb=1, timeout_s=60),
                hardware=HardwareSpec(device="cuda"), backend="standalone")
    plan = compile_plan(spec, all_caps())
    server = ServerProcess(plan)
    server.start()
    try:
        client = ServerClient(server.url, server.token, 120, server.describe, transport="cuda_ipc")
        client.wait_healthy(300, server.alive)
        yield plan, ServedEngine(client, load_tokenizer(plan.spec.model), plan.spec.rollout, starts_in_sync=True)
    finally:
        server.stop()


def test_push_moves_every_weight_exactly(served):
    from rlspec.models.factory import load_model
    from rlspec.sync import LocalWeights, build_transport

    plan, engine = served
    model = load_model(plan.spec.model, 123).cuda()  # other weights than the server's
    source = LocalWeights(lambda: model.state_dict().items())
    transport = build_transport("cuda_ipc", plan.spec.sync)
    transport.connect(engine, source)
    try:
        for _ in range(2):
            with torch.no_grad():
                model.model.norm.weight.add_(0.5)
            moved = transport.push(source, engine)
            got = dict(engine.named_weights())
            assert all(torch.equal(got[n], t.cpu()) for n, t in model.state_dict().items())
        assert moved == sum(t.numel() * t.element_size() for t in model.state_dict().values())
        transport.spec = replace(plan.spec.sync, bucket_mb=2)  # a new layout: new buckets, opened anew
        with torch.no_grad():
            model.model.norm.weight.add_(0.5)
        transport.push(source, engine)
        got = dict(engine.named_weights())
        assert all(torch.equal(got[n], t.cpu()) for n, t in model.state_dict().items())
    finally:
        transport.close()


def test_a_source_missing_one_tensor_fails_naming_it(served):
    from rlspec.models.factory import load_model
    from rlspec.sync import LocalWeights, SyncError, build_transport

    plan, engine = served
    model = load_model(plan.spec.model, 0).cuda()
    source = LocalWeights(lambda: ((n, t) for n, t in model.state_dict().items() if n != "model.norm.weight"))
    transport = build_transport("cuda_ipc", plan.spec.sync)
    with pytest.raises(SyncError, match=r"never written: model\.norm\.weight"):
        transport.push(source, engine)


def test_graph_replayed_checksums_equal_launched_ones_and_follow_the_bytes():
    from rlspec.sync.base import checksums
    from rlspec.sync.staging import BucketChecksums

    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = [[torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) for n in (5, 64, 1000)],
               [torch.randn(7, 3, device="cuda", generator=gen)]]
    sums = BucketChecksums(tensors)
    flat = [t for bucket in tensors for t in bucket]
    assert torch.equal(sums(), checksums(flat))
    assert sums.graphs is not None  # replayed, not launched
    before = sums(0)
    tensors[0][1].view(torch.int16)[3] += 1  # one bit pattern changes in place
    after = sums(0)
    assert torch.equal(after, checksums(tensors[0])) and not torch.equal(after[1], before[1])
    assert torch.equal(after[[0, 2]], before[[0, 2]])
    # Storage freed and given back (rollout.free_during_train=kv_cache_and_weights) moves the tensors: the graphs
    # are captured again over the new addresses, not replayed over the freed ones.
    keep = [t.clone() for t in tensors[0]]
    moved = [t.data_ptr() for t in tensors[0]]
    for t in tensors[0]:
        t.untyped_storage().resize_(0)
    squat = [torch.zeros_like(k) for k in keep]  # takes the freed blocks: the storage comes back elsewhere
    for t, k in zip(tensors[0], keep):
        t.untyped_storage().resize_(k.numel() * k.element_size())
        t.copy_(k)
    assert all(t.data_ptr() != old for t, old in zip(tensors[0], moved))
    assert torch.equal(sums(0), checksums(keep)) and torch.equal(sums(0), after)
    del squat
