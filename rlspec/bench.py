"""`rlspec bench`: the same spec on several backends, side by side.

Each backend runs the full `rlspec run` in its own process (so one backend's cached device memory and
peak-memory counter cannot leak into the next one's numbers) into OUT/<backend>/; the bench reads back
`metrics.jsonl` and reports medians over the steps after the first (`warmup_steps`), since the first
step pays for compilation, allocator growth and connection set-up.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from .metrics import read_metrics
from .errors import RunError
from .run import build_plan

COLUMNS = ("perf/tokens_per_s", "timing_s/step", "timing_s/gen", "timing_s/train", "timing_s/sync", "sync/bytes",
           "mem/peak_gb")


def summarise(rows: list[dict], warmup_steps: int) -> dict:
    """Median of each column over the steps after warm-up (all steps if the run is that short)."""
    measured = rows[warmup_steps:] or rows
    return {key: statistics.median(r[key] for r in measured) for key in COLUMNS} | {"steps_measured": len(measured)}


def bench(spec_path: str, overrides: Sequence[str], backends: Sequence[str], out: Path, warmup_steps: int = 1) -> dict:
    """Run `spec_path` on each backend (all plans are compiled first, so a bad spec fails before any run)."""
    for name in backends:
        build_plan(spec_path, overrides, name)
    results, failures = {}, {}
    for name in backends:
        run_dir = out / name
        proc = subprocess.run([sys.executable, "-m", "rlspec.cli", "run", spec_path, *overrides, "--backend", name,
                               "--out", str(run_dir), "--no-progress"], capture_output=True, text=True)
        if proc.returncode != 0:
            failures[name] = proc.stderr.strip().splitlines()[-20:]
            continue
        results[name] = summarise(read_metrics(run_dir / "metrics.jsonl"), warmup_steps)
    report = {"spec": spec_path, "overrides": list(overrides), "warmup_steps": warmup_steps, "backends": results,
              "failed": failures}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    if results:
        _plot(results, out / "bench.png")
    if failures:
        name, lines = next(iter(failures.items()))
        raise RunError(f"bench: backend(s) {', '.join(failures)} failed (the others are in {out}/bench.json)",
                       "\n".join(lines))
    return report


def table(report: dict) -> str:
    names = list(report["backends"])
    head = f"{'metric (median)':<20}" + "".join(f"{n:>14}" for n in names)
    lines = [head, "-" * len(head)]
    for key in COLUMNS:
        lines.append(f"{key:<20}" + "".join(f"{report['backends'][n][key]:>14.4g}" for n in names))
    if len(names) > 1:
        base = report["backends"][names[0]]["perf/tokens_per_s"]
        lines.append(f"{'tokens/s ratio':<20}" + "".join(
            f"{report['backends'][n]['perf/tokens_per_s'] / base:>14.3f}" for n in names))
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra is optional; the JSON and the table carry the numbers
        return
    names = list(results)
    fig, (split, speed) = plt.subplots(1, 2, figsize=(10, 4))
    bottom = [0.0] * len(names)
    for part in ("timing_s/gen", "timing_s/train", "timing_s/sync"):
        values = [results[n][part] for n in names]
        split.bar(names, values, bottom=bottom, label=part.split("/")[1])
        bottom = [b + v for b, v in zip(bottom, values)]
    split.set_ylabel("median seconds per step")
    split.legend()
    speed.bar(names, [results[n]["perf/tokens_per_s"] for n in names])
    speed.set_ylabel("median tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
