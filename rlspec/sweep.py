"""`rlspec run SPEC -m key=a,b key2=x,y` (and `rlspec bench ... -m`): one job per combination, through Hydra's sweep.

The overrides are parsed by Hydra's override grammar and expanded by its `BasicSweeper` (choices `a,b`,
`choice(a,b)`, `range(1,4)`, a preset group's `glob(pattern)`; every combination of the swept keys, in the order the keys are given). Every job's spec
is compiled before the first one starts, so a bad value in any combination is exit 2 with nothing run. Then the jobs
run one after another, each a fresh `rlspec` process writing OUT/<n>/ (its overrides in OUT/<n>/overrides.json); one
that fails does not stop the next. The summary (OUT/sweep.json, and a table on stdout) gives per job its overrides,
exit code, final `reward/mean`, steps per second and wall time; the sweep exits 1 when any job failed, naming them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from .errors import SpecError

SUMMARY = "sweep.json"


def expand(overrides: Sequence[str]) -> tuple[list[list[str]], list[str]]:
    """(every job's override list, the swept keys), by Hydra's own grammar and sweeper; `SpecError` for what it
    cannot parse or expand."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parser = OverridesParser.create()
        parsed = [_glob_as_choice(parser, o) for o in parser.parse_overrides(list(overrides))]
        [jobs] = BasicSweeper.split_arguments(parsed, max_batch_size=None)
        swept = [override.get_key_element() for override in parsed if override.is_sweep_override()]
    except HydraException as err:
        raise SpecError("-m", f"cannot expand the sweep: {str(err).splitlines()[0]}",
                        "write each swept key as key=a,b or key=choice(a,b) or key=range(start,stop[,step]) "
                        "or a preset group as group=glob(pattern) (interval() is not supported)") from None
    return jobs, swept


def _glob_as_choice(parser, override):
    """`model=glob(qwen2_*)`: the shipped presets of that group whose names match, as a choice sweep (Hydra's
    sweeper leaves globs to its config loader, which the spec's composition does not share with it)."""
    from hydra.core.override_parser.types import ValueType

    if override.value_type != ValueType.GLOB_CHOICE_SWEEP:
        return override
    from .spec import preset_names
    from .spec.load import PRESETS_DIR

    group = override.get_key_element()
    if not (PRESETS_DIR / group).is_dir():
        raise SpecError("-m", f"{override.input_line}: glob() sweeps a preset group, and {group} is not one",
                        f"use glob() on one of: {', '.join(sorted(p.name for p in PRESETS_DIR.iterdir() if p.is_dir()))}")
    names = override.value().filter(preset_names(group))
    if not names:
        raise SpecError("-m", f"{override.input_line} matches no preset",
                        f"the {group} presets are: {', '.join(preset_names(group))}")
    [choice] = parser.parse_overrides([f"{group}=choice({','.join(names)})"])
    return choice


def _check_out(out: Path) -> None:
    if (out / SUMMARY).exists() or any(out.glob("*/metrics.jsonl")) or any(out.glob("*/bench.json")):
        raise SpecError("--out", f"{out} already holds a sweep", "choose a new --out directory")
    if out.exists() and not out.is_dir():
        raise SpecError("--out", f"{out} is a file", "choose a directory path for --out")


def sweep(command: str, spec_path: str, overrides: Sequence[str], out: Path, options: Sequence[str] = (),
          backend: str | None = None) -> int:
    """Run `rlspec <command> SPEC <job overrides> <options> --out OUT/<n>` per job; print and write the summary;
    return 0 if every job succeeded, else 1."""
    jobs, swept = expand(overrides)
    _check_out(out)
    from .plan import build_plan

    for index, job in enumerate(jobs):  # every combination compiles, or nothing runs
        try:
            build_plan(spec_path, job, backend, full=False)
        except SpecError as err:
            named = " ".join(o for o in job if o.split("=", 1)[0] in swept) or "no swept key"
            raise SpecError(err.where, f"{err.problem} (in sweep job {index}: {named})", err.fix) from None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpecError("--out", f"cannot create {out}: {err.strerror or err}", "choose a writable --out") from None
    results = []
    for index, job in enumerate(jobs):
        job_out = out / str(index)
        job_out.mkdir(exist_ok=True)
        (job_out / "overrides.json").write_text(json.dumps(job) + "\n")
        named = " ".join(o for o in job if o.split("=", 1)[0] in swept) or "(nothing swept)"
        print(f"rlspec: sweep job {index} ({index + 1} of {len(jobs)}): {named} -> {job_out}", file=sys.stderr, flush=True)
        argv = [sys.executable, "-m", "rlspec.cli", command, spec_path, *job, *options, "--out", str(job_out)]
        if backend is not None:
            argv += ["--backend", backend]
        start = time.monotonic()
        try:
            code = subprocess.run(argv).returncode
        except KeyboardInterrupt:  # the job got the same SIGINT; stop the sweep, keep what ran
            results.append(_result(index, job, swept, job_out, 130, time.monotonic() - start, command))
            _write(out, spec_path, overrides, swept, results, len(jobs))
            raise
        results.append(_result(index, job, swept, job_out, code, time.monotonic() - start, command))
        _write(out, spec_path, overrides, swept, results, len(jobs))  # after each job: a crash loses nothing
    print(table(results))
    print(f"rlspec: sweep summary in {out / SUMMARY}", file=sys.stderr)
    failed = [r for r in results if r["exit_code"] != 0]
    if failed:
        names = ", ".join(f"{r['index']} ({' '.join(r['swept'])}: exit {r['exit_code']})" for r in failed)
        print(f"rlspec: {len(failed)} of {len(jobs)} sweep jobs failed: {names}; their output is in OUT/<n>/run.log",
              file=sys.stderr)
        return 1
    return 0


def _result(index: int, job: list[str], swept: list[str], job_out: Path, code: int, wall_s: float,
            command: str) -> dict:
    result = {"index": index, "swept": [o for o in job if o.split("=", 1)[0] in swept], "overrides": job,
              "out": str(job_out), "exit_code": code, "wall_s": round(wall_s, 3), "steps": 0, "final_reward_mean": None,
              "steps_per_s": None}
    if command == "bench":
        bench = job_out / "bench.json"
        result["bench"] = json.loads(bench.read_text())["backends"] if bench.is_file() else None
        return result
    metrics = job_out / "metrics.jsonl"
    if metrics.is_file():
        from .runtime.metrics import read_metrics

        rows = read_metrics(metrics)
        step_s = sum(row["timing_s/step"] for row in rows if row.get("timing_s/step"))
        result.update(steps=len(rows), final_reward_mean=rows[-1]["reward/mean"] if rows else None,
                      steps_per_s=round(len(rows) / step_s, 4) if step_s else None)
    return result


def _write(out: Path, spec_path: str, overrides: Sequence[str], swept: list[str], results: list[dict],
           num_jobs: int) -> None:
    report = {"spec": spec_path, "overrides": list(overrides), "swept": swept, "num_jobs": num_jobs, "jobs": results}
    staging = out / (SUMMARY + ".tmp")
    staging.write_text(json.dumps(report, indent=2) + "\n")
    staging.replace(out / SUMMARY)


def table(results: list[dict]) -> str:
    """The summary as a plain-text table, the swept overrides of each job: one line per job (per job and backend for
    a bench sweep, with the bench's median completion tokens/s where a run has its final reward)."""
    bench = any("bench" in r for r in results)
    header = ("job", "swept", "exit", "completion tok/s" if bench else "final reward/mean", "steps/s", "wall s")
    lines = []
    for r in results:
        if bench:
            for label, row in (r["bench"] or {"-": {}}).items():
                lines.append((str(r["index"]), f"{' '.join(r['swept'])} [{label}]", str(r["exit_code"]),
                              _cell(row.get("perf/completion_tokens_per_s")), _cell(_inverse(row.get("timing_s/step"))),
                              _cell(r["wall_s"])))
            continue
        lines.append((str(r["index"]), " ".join(r["swept"]), str(r["exit_code"]), _cell(r["final_reward_mean"]),
                      _cell(r["steps_per_s"]), _cell(r["wall_s"])))
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *lines])


def _inverse(value) -> float | None:
    return 1 / value if isinstance(value, (int, float)) and value > 0 else None


def _cell(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
