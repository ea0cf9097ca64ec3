"""How long the CPU ops of a train step's batch packing take in a process that holds one in-process deepspeed rank
(`InProcessGroup`, the tiny model on CUDA, bf16, AdamW), before the rank is set up, after, and after two steps; and
the process's threads (name, CPU affinity, state). Run by `tests/gpu/measure.sh threads` (STAGES=, default "1 3")
from outside the project root with ROOT set to it, for the tests' helpers.

    python3 tests/gpu/probe_threads.py STAGE [OVERRIDE...]
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.append(os.environ["ROOT"])

from rlspec.cluster.ray_group import InProcessGroup  # noqa: E402
from rlspec.core.backend import all_caps, create_backend  # noqa: E402
from rlspec.spec import compile_plan, load_spec  # noqa: E402
from tests.backends.ranks import TINY, fixed_batch, run_steps  # noqa: E402


def packing_ms() -> float:
    """Median of 20: the index and repeat_interleave ops `rlspec.core.packing` runs on a 64 x 700 batch."""
    values, real = torch.randn(64, 700), torch.rand(64, 700) > 0.3
    times = []
    for _ in range(20):
        start = time.perf_counter()
        index = real.reshape(-1).nonzero().squeeze(1)
        values.reshape(-1)[index]
        torch.repeat_interleave(torch.arange(64), torch.full((64,), 500))
        times.append(time.perf_counter() - start)
    return round(sorted(times)[10] * 1e3, 3)


def threads() -> dict[tuple[str, int, str], int]:
    """(name, CPUs in its affinity, state) of this process's threads, with how many share them."""
    counts: dict[tuple[str, int, str], int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            state = open(f"/proc/self/task/{tid}/stat").read().split()[2]
            key = (name, len(os.sched_getaffinity(int(tid))), state)
        except OSError:
            continue
        counts[key] = counts.get(key, 0) + 1
    return counts


def main() -> None:
    stage, extra = sys.argv[1], sys.argv[2:]
    print(f"stage {stage} {extra}: torch threads {torch.get_num_threads()}, packing before setup {packing_ms()} ms",
          flush=True)
    overrides = ["model.dtype=bfloat16", "hardware=gpu1", "algorithm.optimizer=adamw",
                 f"hardware.deepspeed.zero_stage={stage}", *extra]
    plan = compile_plan(load_spec(TINY, overrides, "deepspeed"), all_caps())
    backend = create_backend("deepspeed")
    backend.group_class = InProcessGroup
    backend.setup(plan)
    try:
        print(f"  after setup {packing_ms()} ms (torch threads {torch.get_num_threads()})", flush=True)
        run_steps(backend, plan, fixed_batch(), steps=2)
        torch.cuda.synchronize()
        print(f"  after two steps {packing_ms()} ms", flush=True)
        print(f"  threads {threads()}", flush=True)
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
