"""Where a serving pool's admission goes (GPU): the bench spec's engine, its pool (`make_pool`, as `rlspec serve`
builds it), then `admit` of R new rows (R = 1, 16, 64) of 32-token prompts, timed with the device synced, and
admissions as the server makes them (into a pool with rows in flight, growing, a decode run between), admissions of
row counts and prompt widths not seen before, and the parts of one admit of 64 rows under torch.profiler (host time
per op, the top lines).
    python tests/gpu/probe_admit.py examples/bench_qwen0p5b.yaml"""

import random
import sys
import time

import torch

from rlspec.run import build_plan
from rlspec.serve.pool import RowSampling
from rlspec.serve.process import build_engine
from rlspec.serve.scheduler import make_pool


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    began = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - began) * 1e3


plan, _ = build_plan(sys.argv[1], sys.argv[2:])
engine = build_engine(plan)
pool = make_pool(engine)
_, warm_ms = timed(pool.warm_up)
buckets = sorted(pool.prefills.graphs)
pool.prefills.graphs.clear()
_, again_ms = timed(lambda: [pool.prefills.graph(tokens) for tokens in buckets])
print(f"warm_up {warm_ms / 1e3:.2f} s: {pool.captures} graphs captured (decode steps; packed prefills of {buckets} "
      f"tokens, packed prefill {pool.prefills.packed}); the prefills' captures again {again_ms / 1e3:.2f} s", flush=True)
rng = random.Random(0)
vocab = min(len(engine.tokenizer), 30000)
ids = iter(range(10 ** 6))


def rows(count):
    return [(next(ids), [rng.randrange(4, vocab) for _ in range(32)], RowSampling(key=next(ids), max_tokens=64))
            for _ in range(count)]


def drain():
    while pool.live:
        pool.run()
    pool.shrink()


for count in (1, 16, 64, 1, 16, 64):
    batch = rows(count)
    _, prefill_ms = timed(lambda: pool.prefills.prefill([ids_ for _, ids_, _ in batch]))
    pool.prefills.cache.clear()
    _, admit_ms = timed(lambda: pool.admit(batch))
    _, drain_ms = timed(drain)
    print(f"rows {count:3d}: prefill alone {prefill_ms:7.1f} ms, admit {admit_ms:7.1f} ms, decode 64 steps "
          f"{drain_ms:7.1f} ms", flush=True)

# As the server admits (docs/serving_concurrency.md: ~93 ms an admission under 64 streams, in one process or with
# the engine in a process of its own, against the idle-pool admissions above): the pool's derived weights refreshed
# when it is idle (the scheduler does it before rows start in an idle pool), then admissions of K rows into a pool
# with rows in flight, growing, one decode run between them. Host ms (the call returns) and synced ms per admission.
drain()
_, refresh_ms = timed(pool.refresh_weights)
print(f"refresh_weights on an idle pool {refresh_ms:7.1f} ms", flush=True)
for count in (13, 32):
    drain()
    pool.shrink()
    lines = []
    for _ in range(5):
        batch = rows(min(count, pool.free()))
        sync()
        began = time.perf_counter()
        pool.admit(batch)
        host_ms = (time.perf_counter() - began) * 1e3
        sync()
        lines.append(f"{host_ms:.1f}/{(time.perf_counter() - began) * 1e3:.1f} ms ({pool.slots} slots)")
        pool.run()
    print(f"live rows {count:3d} an admission: " + ", ".join(lines), flush=True)

# Shapes not seen before, as the server's admissions come (any number of rows, prompts of any widths): before the
# prefill left cuDNN's attention out, each new shape cost ~70 ms more on an H100 (its execution plan).
for count, widths in ((5, (32,)), (11, (32,)), (23, (17, 45)), (29, (8, 30, 61)), (29, (9, 31, 60))):
    drain()
    batch = [(next(ids), [rng.randrange(4, vocab) for _ in range(widths[i % len(widths)])],
              RowSampling(key=next(ids), max_tokens=64)) for i in range(count)]
    _, admit_ms = timed(lambda: pool.admit(batch))
    print(f"new shape: rows {count:3d}, prompt widths {widths}: admit {admit_ms:7.1f} ms", flush=True)
drain()

batch = rows(64)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    pool.admit(batch)
    sync()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
