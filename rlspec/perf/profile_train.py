"""Where the train phase's time goes, on one GPU: `python -m rlspec.perf.profile_train SPEC [overrides] [--steps N]`.

Runs the spec's steps (sample, score, `loop.update`) and, for the train phase of the steps after the first
(warm-up), prints:

- the train phase's median wall time and MFU as `rlspec bench` counts it; for the last step, the summed
  GPU kernel time (over the wall time, how busy the GPU is: a low share means the host does not keep it fed);
- peak device memory of the generation phase and of the train phase, each measured alone, and how many memory
  segments the CUDA allocator had to add in each measured train phase (each a cudaMalloc on the host);
- host-device synchronisations in the train phase (`torch.cuda.set_sync_debug_mode`), by the source line
  that asked for them, and the time the host spent in Python's garbage collector, by generation;
- how many frames torch.compile compiled during the measured steps (a recompile there costs seconds, and past
  Dynamo's recompile limit a frame runs eager from then on);
- the last step's top CUDA kernels by their own GPU time (torch.profiler);
- with `--trace FILE`, the last step's timeline as a Chrome trace (open it in Perfetto) to see where the GPU
  idles; `--stacks` adds Python stacks (what the host was doing then, though recording them slows the host).

The train phase runs on the standalone backend, or with `--backend fsdp|deepspeed` on that backend's one
trainer rank in this process (`rlspec.cluster.ray_group.InProcessGroup`: the rank's own code, without the Ray
actor, so the profiler sees its kernels and host work); the standalone backend's engine samples either way.
The engine is not given the new weights between steps (no transport runs): with `sync.method=auto` on one
GPU it shares the trainer's weights anyway, and the train phase is what is measured.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
import warnings
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlspec.perf.profile_train", description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=3, help="steps to run; the first is warm-up, not measured")
    parser.add_argument("--rows", type=int, default=25, help="kernels to list")
    parser.add_argument("--trace", metavar="FILE", help="write the last step's Chrome trace here")
    parser.add_argument("--stacks", action="store_true", help="record Python stacks in the trace (slows the host)")
    parser.add_argument("--backend", default="standalone", choices=("standalone", "fsdp", "deepspeed"),
                        help="the trainer to profile (fsdp and deepspeed: one rank, in this process)")
    parser.add_argument("--gc", default="paused", choices=("paused", "automatic"),
                        help="automatic: leave Python's garbage collector on during the train phase's micro-batch "
                             "loops (to measure what pausing it gives, rlspec.runtime.collector)")
    parser.add_argument("--split", default="even", choices=("even", "first-fit"),
                        help="first-fit: token-budget micro-batches as first-fit decreasing packs them, not evened "
                             "out (to measure what evening them out gives, rlspec.core.packing)")
    parser.add_argument("--head", default="triton", choices=("triton", "compiled"),
                        help="compiled: the log-prob head's reductions over the logits torch.compile'd, not the Triton "
                             "kernels (to measure what rlspec.core.fused_head gives)")
    args = parser.parse_args(argv)
    if args.gc == "automatic":
        from ..core import policy

        policy.collection_paused = nullcontext
    if args.split == "first-fit":
        from ..core import packing

        packing._balanced = lambda bins, lengths, budget: bins
    if args.head == "compiled":
        from ..core import fused_head

        fused_head.available = lambda logits: False
    if not torch.cuda.is_available():
        raise SystemExit("profile_train needs a CUDA device")

    from ..core.step import rollout_batch, update
    from ..models.base import pad_token_id
    from ..runtime.metrics import PhaseTimer
    from .bench import _train_flops

    plan, task, backend = standalone_backend(args.spec, args.overrides)
    engine, sampler = backend.rollout_engine(), backend
    if args.backend != "standalone":
        plan, backend = in_process_backend(args.spec, args.overrides, args.backend)
    pad_id = pad_token_id(engine.tokenizer)
    flops = _train_flops(plan)
    walls, mfus, syncs, prepares, mallocs = [], [], collections.Counter(), [], []
    prepare = getattr(backend, "prepare_update", None)
    collector = GCTimer()
    peaks = {"gen": 0.0, "train": 0.0}
    compiled_after_warmup = 0
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA],
                                      with_stack=args.stacks)
    try:
        for step in range(args.steps):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if prepare is not None:  # as the loop does: before sampling, which it overlaps in a run with actors
                start = time.perf_counter()
                prepare()
                torch.cuda.synchronize()
                prepares.append(time.perf_counter() - start)
            batch, _ = rollout_batch(plan, engine, task, step, pad_id, PhaseTimer())
            torch.cuda.synchronize()
            peaks["gen"] = max(peaks["gen"], torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
            last = step == args.steps - 1
            if last:  # the kernel table and GPU time: the last step's train phase alone
                profiler.start()
            segments = torch.cuda.memory_stats().get("segment.all.allocated", 0)
            start = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    with collector.counting(step > 0):
                        update(plan, backend, batch)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
            if last:
                profiler.stop()
            peaks["train"] = max(peaks["train"], torch.cuda.max_memory_allocated() / 2**30)
            if step == 0:
                compiled_after_warmup = _compiled_frames()
                continue  # warm-up
            walls.append(wall)
            mallocs.append(torch.cuda.memory_stats().get("segment.all.allocated", 0) - segments)
            syncs.update(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
            if flops is not None:
                mfus.append(flops.flops(float(batch.attention_mask.sum())) / (wall * flops.peak))
    finally:
        backend.shutdown()
        if sampler is not backend:
            sampler.shutdown()
    steps = len(walls)
    if not steps:
        raise SystemExit("run at least 2 steps (the first is warm-up)")
    wall, busy = statistics.median(walls), _kernel_seconds(profiler)
    print(f"{args.backend} train phase, median of {steps} step(s): {wall:.3f} s wall" +
          (f", MFU {statistics.median(mfus):.1%}" if mfus else "") +
          f"; last step: {walls[-1]:.3f} s wall, {busy:.3f} s of GPU kernels ({busy / walls[-1]:.0%} busy)")
    print(f"train phase wall per step (s): {[round(w, 3) for w in walls]}")
    if prepares and max(prepares) > 1e-3:  # a backend whose ranks prepare nothing says nothing
        print(f"prepare_update before sampling (beside the engine in a run with actors; not in the train phase): "
              f"median {statistics.median(prepares[1:]) * 1e3:.1f} ms")
    print(f"peak memory: generation {peaks['gen']:.2f} GB, train {peaks['train']:.2f} GB")
    print(f"device memory segments the allocator had to add (cudaMalloc) in the train phase, per step: {mallocs}")
    print(f"host-device syncs in the train phase: {sum(syncs.values()) / steps:.0f} per step")
    for where, count in syncs.most_common(15):
        print(f"  {count / steps:6.0f}  {where}")
    collections_per_step = ", ".join(f"generation {g}: {n / steps:.0f} x, {t / steps * 1e3:.1f} ms"
                                     for g, (n, t) in sorted(collector.totals.items()))
    print(f"Python garbage collection in the train phase, per step: {collections_per_step or 'none'}")
    print(f"torch.compile frames compiled after the warm-up step: {_compiled_frames() - compiled_after_warmup} "
          "(recompiles inside the measured steps; TORCH_LOGS=recompiles says why)")
    print(kernel_table(profiler, args.rows))
    if args.trace:
        profiler.export_chrome_trace(args.trace)


def standalone_backend(spec: str, overrides: list[str]):
    """The plan, task and set-up standalone backend of `spec` with `overrides` (the profilers' common start)."""
    from ..core.backend import create_backend
    from ..run import build_plan

    plan, task = build_plan(spec, overrides, "standalone")
    backend = create_backend("standalone")
    backend.setup(plan)
    return plan, task, backend


class GCTimer:
    """Counts and times Python's garbage collections (`gc.callbacks`) while `counting(True)` is entered."""

    def __init__(self) -> None:
        self.totals: dict[int, tuple[int, float]] = {}
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        count, seconds = self.totals.get(info["generation"], (0, 0.0))
        self.totals[info["generation"]] = (count + 1, seconds + time.perf_counter() - self._start)

    @contextmanager
    def counting(self, enabled: bool) -> Iterator[None]:
        import gc

        if enabled:
            gc.callbacks.append(self._callback)
        try:
            yield
        finally:
            if enabled:
                gc.callbacks.remove(self._callback)


def in_process_backend(spec: str, overrides: list[str], name: str):
    """The plan and set-up `name` backend (a rank-group backend) with its one trainer rank in this process."""
    from ..cluster.ray_group import InProcessGroup
    from ..core.backend import create_backend
    from ..run import build_plan

    plan, _ = build_plan(spec, overrides, name)
    backend = create_backend(name)
    backend.group_class = InProcessGroup
    backend.setup(plan)
    return plan, backend


def _compiled_frames() -> int:
    """Frames Dynamo has compiled in this process so far (each recompile counts one)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def _kernel_seconds(profiler) -> float:
    """Summed GPU time of the recorded kernels and copies."""
    return sum(_self_device_us(e) for e in profiler.key_averages() if _on_device(e)) / 1e6


def _on_device(event) -> bool:
    kind = getattr(event, "device_type", None)
    return kind is not None and kind != torch.autograd.DeviceType.CPU


def _self_device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def kernel_table(profiler, rows: int, name_width: int = 70) -> str:
    """A finished torch.profiler's events, the `rows` largest by their own GPU time."""
    events = profiler.key_averages()
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    return events.table(sort_by=key, row_limit=rows, max_name_column_width=name_width)


if __name__ == "__main__":
    main()
