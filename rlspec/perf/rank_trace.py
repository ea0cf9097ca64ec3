"""Per-rank timelines of the train phase and the push: where a step's time goes on several GPUs.

Set `RLSPEC_RANK_TRACE=DIR` in the environment of `rlspec run` or `rlspec bench` (Ray backends: the driver hands it
to every trainer rank) and each trainer rank records one train phase (its `forward_backward` through its
`optimizer_step`) and one push (its part of `run_sender`: the gathers, the staging copy, the send) under
`torch.profiler`, the `RLSPEC_RANK_TRACE_CALL`-th of each (default 2: the third, after warm-up and compilation).
Each window is written as `DIR/rank<R>_<phase>.json`:

- `wall_s`: the window's wall time, both ends synchronised with the device;
- `busy_s`: the union of all kernel intervals (any stream), and `compute_busy_s`: the same without the
  collectives; `host_gap_s = wall_s - busy_s` is time the GPU had nothing to run (the host did not feed it, or
  it waited on a collective's peer);
- `kernel_s`: summed kernel time by kind (`gemm`, `attention`, `all_gather`, `reduce_scatter`, `all_reduce`,
  `broadcast`, `optimizer`, `copy`, `other`), and `exposed_comm_s`: collective time not overlapped by compute;
- `host_ops_ms`: the operators the host spent most time in (self CPU ms, with their call counts).

Every window, profiled or not, also appends a row to `DIR/rank<R>_calls.jsonl`: its wall time and what changed
in it (`counters`: graphs Dynamo compiled, the CUDA allocator's device allocations, frees and retries), which says
whether an early step is slow for a recompile or a growing memory pool.
`python -m rlspec.perf.rank_trace DIR` prints them as one table (a row per rank and phase). With
`RLSPEC_RANK_TRACE_CHROME=1` rank 0 also writes its windows' Chrome traces (`rank0_<phase>.trace.json.gz`).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

TRACE_ENV = "RLSPEC_RANK_TRACE"
CALL_ENV = "RLSPEC_RANK_TRACE_CALL"
CHROME_ENV = "RLSPEC_RANK_TRACE_CHROME"
ENV_KEYS = (TRACE_ENV, CALL_ENV, CHROME_ENV)

KINDS = (("all_gather", ("allgather", "all_gather")), ("reduce_scatter", ("reducescatter", "reduce_scatter")),
         ("all_reduce", ("allreduce", "all_reduce")), ("broadcast", ("broadcast",)),
         ("attention", ("flash", "fmha", "attention", "sdpa")),
         ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "matmul", "cublas")),
         ("optimizer", ("adam", "multi_tensor", "foreach")),
         ("copy", ("copy", "memcpy", "memset", "cat", "split", "chunk", "to_copy", "fill")))
COMM = {"all_gather", "reduce_scatter", "all_reduce", "broadcast"}


def counters() -> dict[str, float]:
    """Process-wide counts that explain a slow call: graphs Dynamo compiled (`compiled_graphs`: a recompile for a
    new shape or guard) and, on CUDA, the caching allocator's device allocations, frees and retries (a pool still
    growing, or freeing its cache to fit) and reserved GB."""
    import torch

    out: dict[str, float] = {}
    try:
        from torch._dynamo.utils import counters as dynamo

        out["compiled_graphs"] = float(dynamo["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - no Dynamo here: the other counts still help
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        for key, name in (("num_device_alloc", "device_allocs"), ("num_device_free", "device_frees"),
                          ("num_alloc_retries", "alloc_retries")):
            out[name] = float(stats.get(key, 0))
        out["reserved_gb"] = stats.get("reserved_bytes.all.current", 0) / 2**30
    return out


def trace_env() -> dict[str, str]:
    """The trace settings of this process's environment, to hand to the ranks."""
    return {key: os.environ[key] for key in ENV_KEYS if os.environ.get(key)}


def kind_of(name: str) -> str:
    """The kind of a CUDA kernel by its name (`KINDS`, first match; NCCL's kernels name their collective)."""
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(key in low for key in keys)), "other")


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of `(start_us, end_us)` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e6


def summarize(kernels: list[tuple[str, float, float]], wall_s: float) -> dict:
    """The window's figures from its kernels `(name, start_us, end_us)` (module docstring)."""
    by_kind: dict[str, float] = {}
    spans: dict[str, list[tuple[float, float]]] = {"all": [], "compute": [], "comm": []}
    for name, start, end in kernels:
        kind = kind_of(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (end - start) / 1e6
        spans["all"].append((start, end))
        spans["comm" if kind in COMM else "compute"].append((start, end))
    busy, compute = union_s(spans["all"]), union_s(spans["compute"])
    return {"wall_s": wall_s, "busy_s": busy, "compute_busy_s": compute, "host_gap_s": max(wall_s - busy, 0.0),
            "exposed_comm_s": max(busy - compute, 0.0), "num_kernels": len(kernels),
            "kernel_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))}


class RankTracer:
    """One rank's recorder: `begin(phase)` and `end(phase)` around the phase's calls; records the
    `RLSPEC_RANK_TRACE_CALL`-th window of each phase, does nothing without `RLSPEC_RANK_TRACE`."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.folder = os.environ.get(TRACE_ENV)
        self.call = int(os.environ.get(CALL_ENV, "2"))
        self.chrome = bool(os.environ.get(CHROME_ENV)) and rank == 0
        self.calls: dict[str, int] = {}
        self.open: tuple[str, object, float] | None = None
        self.counted: tuple[str, int, dict, float] | None = None

    def begin(self, phase: str) -> None:
        if not self.folder or self.open is not None:
            return
        import torch

        count = self.calls.get(phase, 0)
        self.calls[phase] = count + 1
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
        self.counted = (phase, count, counters(), time.perf_counter())
        if count != self.call:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=activities)
        prof.start()
        self.open = (phase, prof, time.perf_counter())

    def _count(self, phase: str) -> None:
        """Append this window's row to `DIR/rank<R>_calls.jsonl` (every call, profiled or not)."""
        if self.counted is None or self.counted[0] != phase:
            return
        import torch

        _, call, before, start = self.counted
        self.counted = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        row = {"rank": self.rank, "phase": phase, "call": call, "wall_s": time.perf_counter() - start,
               "profiled": call == self.call} | {k: v - before.get(k, 0) for k, v in counters().items()}
        folder = Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank{self.rank}_calls.jsonl", "a") as out:
            out.write(json.dumps(row) + "\n")

    def end(self, phase: str) -> None:
        if self.open is None or self.open[0] != phase:
            self._count(phase)
            return
        import torch

        _, prof, start = self.open
        self.open = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        prof.stop()
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA"]
        row = {"rank": self.rank, "phase": phase, "call": self.call} | summarize(kernels, wall)
        row["host_ops_ms"] = host_ops_ms(prof)
        folder = Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{self.rank}_{phase}.json").write_text(json.dumps(row, indent=1))
        if self.chrome:
            raw = folder / f"rank{self.rank}_{phase}.trace.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
        self._count(phase)


def host_ops_ms(prof, top: int = 12) -> dict[str, float]:
    """The `top` operators by the host time spent in them alone (self CPU time, ms): what a window's host gap
    went to."""
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {f"{e.key} x{e.count}": round(e.self_cpu_time_total / 1e3, 3) for e in ops}


def table(folder: str | Path) -> str:
    """The rank windows under `folder` as one text table."""
    rows = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("rank*_*.json"))]
    kinds = sorted({k for r in rows for k in r["kernel_s"]}, key=lambda k: [kind for kind, _ in KINDS].index(k)
                   if k in dict(KINDS) else 99)
    head = ["phase", "rank", "wall", "busy", "gap", "exp.comm"] + kinds
    lines = [" | ".join(head)]
    for r in sorted(rows, key=lambda r: (r["phase"], r["rank"])):
        cells = [r["phase"], str(r["rank"])] + [f"{r[k] * 1e3:.1f}" for k in ("wall_s", "busy_s", "host_gap_s",
                                                                              "exposed_comm_s")]
        lines.append(" | ".join(cells + [f"{r['kernel_s'].get(k, 0.0) * 1e3:.1f}" for k in kinds]))
    for r in sorted(rows, key=lambda r: (r["phase"], r["rank"])):
        if r.get("host_ops_ms"):
            lines.append(f"host ms, {r['phase']} rank {r['rank']}: "
                         + ", ".join(f"{op} {ms:g}" for op, ms in r["host_ops_ms"].items()))
    return "milliseconds per window\n" + "\n".join(lines) + calls_table(folder)


def calls_table(folder: str | Path) -> str:
    """Every window's row from `rank<R>_calls.jsonl` (wall ms and the counts that changed in it), or nothing."""
    lines = []
    for path in sorted(Path(folder).glob("rank*_calls.jsonl")):
        for row in map(json.loads, path.read_text().splitlines()):
            counts = ", ".join(f"{k} {row[k]:g}" for k in ("compiled_graphs", "device_allocs", "device_frees",
                                                          "alloc_retries", "reserved_gb") if row.get(k))
            lines.append(f"rank {row['rank']} {row['phase']} {row['call']}{' (profiled)' if row['profiled'] else ''}: "
                         f"{row['wall_s'] * 1e3:.1f} ms{'; ' + counts if counts else ''}")
    return "\nevery window (wall; what changed in it)\n" + "\n".join(lines) if lines else ""


if __name__ == "__main__":
    print(table(sys.argv[1]))
