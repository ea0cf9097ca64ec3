"""Soak test: thousands of tiny steps in one process, sampling RSS and open file descriptors.

    python examples/soak.py [--steps 2000] [--out outputs/soak] [key=value ...]

Runs `rlspec run examples/tiny.yaml` (standalone backend, smallest batch, checkpoints every 250 steps so
their write/prune path is soaked too) in this process while a thread samples, every `--every-s` seconds,
the resident set size, open file descriptors and threads of the process and the step reached. Writes
`OUT/soak.csv` and `OUT/soak.json`, and prints a summary: the least-squares slope of RSS against the step
after warm-up (`--warmup-steps`, past the first checkpoint), in MB per 1000 steps, and the fd / thread range.
A leak shows as a slope that does not go to zero; "no trend" here means |slope| < 2 MB / 1000 steps
and a constant fd count after warm-up. Not a CI test: it takes minutes.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMALLEST = ["hardware.num_threads=1", "rollout.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=4",
            "rollout.max_new_tokens=4", "checkpoint.every_n_steps=250", "checkpoint.keep_last=2"]
MAX_SLOPE_MB_PER_1000 = 2.0


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


FIELDS = ("t_s", "step", "rss_mb", "fds", "threads")


def sample(out: Path, every_s: float, stop: threading.Event, rows: list[dict]) -> None:
    """Append a sample to `rows` and to OUT/soak.csv (written as it goes: an interrupted soak keeps its data)."""
    metrics = out / "metrics.jsonl"
    start = time.monotonic()
    while not stop.wait(every_s):
        if not metrics.exists():
            continue
        row = {"t_s": round(time.monotonic() - start, 2), "step": metrics.read_text().count("\n"),
               "rss_mb": round(rss_mb(), 2), "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}
        new = not (out / "soak.csv").exists()
        with (out / "soak.csv").open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                writer.writeheader()
            writer.writerow(row)
        rows.append(row)


def slope_per_1000(points: list[tuple[float, float]]) -> float:
    xs, ys = zip(*points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def summarise(rows: list[dict], steps: int, warmup_steps: int) -> dict:
    after = [r for r in rows if r["step"] >= warmup_steps] or rows
    slope = slope_per_1000([(r["step"], r["rss_mb"]) for r in after])
    fds = [r["fds"] for r in after]
    return {
        "steps": steps, "warmup_steps": warmup_steps, "samples": len(rows), "samples_after_warmup": len(after),
        "rss_mb_first": after[0]["rss_mb"], "rss_mb_last": after[-1]["rss_mb"],
        "rss_mb_min": min(r["rss_mb"] for r in after), "rss_mb_max": max(r["rss_mb"] for r in after),
        "rss_slope_mb_per_1000_steps": round(slope, 3),
        "fds_min": min(fds), "fds_max": max(fds), "fds_last": fds[-1],
        "threads_min": min(r["threads"] for r in after), "threads_max": max(r["threads"] for r in after),
        "no_trend": abs(slope) < MAX_SLOPE_MB_PER_1000 and max(fds) - min(fds) <= 2,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default=f"outputs/soak/{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--every-s", type=float, default=1.0)
    parser.add_argument("--warmup-steps", type=int, default=300,
                        help="steps left out of the trend: past the first checkpoint (step 250), whose save path "
                             "allocates once (~24 MB)")
    parser.add_argument("--summarise", metavar="CSV", help="only summarise an existing soak.csv (e.g. of an interrupted soak)")
    args, overrides = parser.parse_known_args()
    if args.summarise:
        with open(args.summarise, newline="") as f:
            rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
        print(json.dumps(summarise(rows, int(max(r["step"] for r in rows)), args.warmup_steps), indent=2))
        return 0
    from rlspec.run import run

    out = Path(args.out)
    rows: list[dict] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(out, args.every_s, stop, rows), daemon=True)
    sampler.start()
    start = time.monotonic()
    try:
        run(str(REPO / "examples" / "tiny.yaml"), [*SMALLEST, f"algorithm.steps={args.steps}", *overrides],
            out=str(out), progress=False)
    finally:
        stop.set()
        sampler.join()
    took = time.monotonic() - start
    summary = {**summarise(rows, args.steps, args.warmup_steps), "wall_s": round(took, 1)}
    (out / "soak.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if summary["no_trend"] else 1


if __name__ == "__main__":
    sys.exit(main())
