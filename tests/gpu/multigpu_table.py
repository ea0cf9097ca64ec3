"""The one table of `measure.sh multigpu_*`: every row its sections wrote so far under OUT, with the ratios the
several-GPU issue asks for beside them. Run by each section at its end (so a call cut short still prints what it
has): `python3 multigpu_table.py OUT`.

Bench rows come from `mg_<row>_bench.json` (medians after the first step, `rlspec bench`), with entropy and grad norm
medians from the row's kept `metrics.jsonl`; push rows from `mg_push_<row>.json` (`rlspec.perf.bench_sync`). A row
named `<backend>_<stage>_<n>gpu` is compared with the same backend and stage on 1 GPU: the train phase's speed-up, the
push's ratio, and entropy and grad norm against the 1-GPU medians (the criteria: 2 ranks >= 1.8x, 4 >= 3.4x, push
<= 1.2x, statistics within 10%). `gen eng s` is the slowest Ray engine's own seconds generating (`gen s` less it is
the samples' transfer and the driver's dispatch). Weak rows (`weak_<n>gpu`) give samples/s per GPU against 1 GPU's
(>= 85%).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def _median(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def _metrics(out: Path, row: str) -> list[dict]:
    rows = []
    for path in sorted(out.glob(f"mg_{row}_*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[1:] or rows  # the first step pays for compilation and capture, as in the bench


def bench_rows(out: Path) -> dict[str, dict]:
    rows = {}
    for path in sorted(out.glob("mg_*_bench.json")):
        row = path.name.removeprefix("mg_").removesuffix("_bench.json")
        report = json.loads(path.read_text())
        result = next(iter(report["backends"].values()), None)
        if result is None:
            rows[row] = {"failed": True}
            continue
        steps = _metrics(out, row)
        slowest = [max((v for k, v in s.items() if k.startswith("timing_s/gen_engine_")), default=None) for s in steps]
        rows[row] = result | {"entropy": _median([s.get("entropy") for s in steps]),
                              "grad_norm": _median([s.get("grad_norm") for s in steps]),
                              "gen_slowest_engine": _median(slowest)}
    for path in sorted(out.glob("mg_*.exit")):  # a row that failed or was cut short before its bench.json
        row = path.name.removeprefix("mg_").removesuffix(".exit")
        code = path.read_text().strip()
        if row not in rows or code != "0":
            rows.setdefault(row, {})["exit"] = code
    return rows


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.{digits}g}"


def _baseline(rows: dict, row: str) -> dict | None:
    match = re.match(r"(.+)_(\d+)gpu$", row)
    if not match or match.group(2) == "1":
        return None
    return rows.get(f"{match.group(1)}_1gpu")


def table(out: Path) -> str:
    rows = bench_rows(out)
    head = ("row", "exit", "GPUs t/e", "step s", "train s", "gen s", "gen eng s", "sync s", "MFU/GPU", "tok/s/GPU",
            "smp/s/GPU", "entropy", "grad", "train x1", "sync x1", "ent x1", "grad x1")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for row, r in rows.items():
        base = _baseline(rows, row)

        def ratio(key, inverse=False):
            if not base or r.get(key) is None or not base.get(key):
                return None
            return base[key] / r[key] if inverse else r[key] / base[key]

        gpus = f"{r.get('gpus/trainer', '-')}/{r.get('gpus/engine', '-')}"
        lines.append(" | ".join([row, r.get("exit", "0"), gpus, _fmt(r.get("timing_s/step")), _fmt(r.get("timing_s/train")),
                                 _fmt(r.get("timing_s/gen")), _fmt(r.get("gen_slowest_engine")),
                                 _fmt(r.get("timing_s/sync")), _fmt(r.get("perf/train_mfu")),
                                 _fmt(r.get("perf/tokens_per_s_per_gpu")), _fmt(r.get("perf/samples_per_s_per_gpu")),
                                 _fmt(r.get("entropy")), _fmt(r.get("grad_norm")),
                                 _fmt(ratio("timing_s/train", inverse=True)), _fmt(ratio("timing_s/sync")),
                                 _fmt(ratio("entropy")), _fmt(ratio("grad_norm"))]))
    weak1 = rows.get("weak_1gpu", {}).get("perf/samples_per_s_per_gpu")
    for row, r in rows.items():
        if row.startswith("weak_") and weak1 and r.get("perf/samples_per_s_per_gpu"):
            lines.append(f"{row}: samples/s per GPU {r['perf/samples_per_s_per_gpu'] / weak1:.2f}x the 1-GPU figure")
    pushes = sorted(out.glob("mg_push_*.json"))
    if pushes:
        lines += ["", "push | GB | push s (no verify) | push s (verify) | raw s | raw | push/raw bandwidth | logprob diff",
                  "--- | --- | --- | --- | --- | --- | --- | ---"]
        for path in pushes:
            p = json.loads(path.read_text())
            lines.append(" | ".join([path.stem.removeprefix("mg_push_"), _fmt(p["bytes"] / 1e9), _fmt(p["push_unverified_s"]),
                                     _fmt(p["push_verified_s"]), _fmt(p["raw_s"]), p["raw_name"],
                                     _fmt(p["unverified_vs_raw_bandwidth"]), _fmt(p.get("logprobs_max_abs_diff"))]))
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
