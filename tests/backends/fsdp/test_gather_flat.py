"""`gather_flat`: one all-gather per bucket rebuilds every FSDP2-sharded tensor exactly, uneven shards included,
side by side in one buffer that `sync.base.buckets` sends as the bucket without copying it."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed

SHAPES = [(5, 3), (1,), (7,), (2, 4), (3, 2, 2), (6,)]
"""Rows that do not divide by 3 ranks (5, 1, 7, 2), one that leaves a rank with no rows at all (1, 2), and one
that divides evenly (3, 6)."""


def _rank(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rlspec.core.shards import gather_flat
    from rlspec.sync.base import buckets

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        generator = torch.Generator().manual_seed(0)
        full = [torch.randn(shape, generator=generator) for shape in SHAPES]
        pending = [(f"t{i}", distribute_tensor(t, mesh, [Shard(0)])) for i, t in enumerate(full)]
        pending.insert(2, ("plain", torch.arange(4.0)))  # a tensor that is not sharded passes through
        got = gather_flat(pending, torch.float64, flat=True)  # on CPU too
        expected = [(f"t{i}", t.double()) for i, t in enumerate(full)]
        expected.insert(2, ("plain", torch.arange(4.0, dtype=torch.float64)))
        rows = [(a, b, tuple(t.shape), t.dtype, bool(torch.equal(t, e)))
                for (a, t), (b, e) in zip(got, expected, strict=True)]
        # Only sharded tensors: one buffer holds them all, and the bucket is that buffer (no copy). A lone tensor
        # is gathered alone (its gather is the tensor when its rows divide; else its chunks are copied out).
        groups = [pending[:2] + pending[3:], pending[:1], pending[-1:]]
        shared = []
        for group in groups:
            tensors = gather_flat(group, torch.float64, flat=True)
            bucket, = buckets(iter(tensors), bucket_mb=1)
            shared.append((bucket.flat.data_ptr() == tensors[0][1].data_ptr(),
                           all(torch.equal(a, b) for (_, a), (_, b) in zip(bucket.unpack(), tensors, strict=True))))
        # A group with a tensor that is not sharded is copied into a bucket of its own
        mixed = gather_flat(pending[:3], torch.float64, flat=True)
        bucket, = buckets(iter(mixed), bucket_mb=1)
        shared.append((bucket.flat.data_ptr() != mixed[0][1].data_ptr(),
                       all(torch.equal(a, b) for (_, a), (_, b) in zip(bucket.unpack(), mixed, strict=True))))
        queue.put((rank, (rows, shared)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 3])  # one rank gathers nothing: its shards are the tensors
def test_uneven_shards_come_back_exact(world):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [context.Process(target=_rank, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in range(world):
        rows, shared = results[rank]
        for got_name, want_name, shape, dtype, equal in rows:
            assert got_name == want_name and dtype == torch.float64 and equal, (rank, got_name, shape)
        assert shared == [(True, True)] * 4, (rank, shared)
