"""`rlspec eval SPEC [-m] --checkpoint DIR | --checkpoints OUT | --model DIR`: the spec's eval set scored on a
checkpoint (of any backend: every one writes the HF model), every checkpoint of a run or of a sweep's jobs, or any
local HF model, with the spec's engine (`rollout`) on the spec's device; `-m` scores each with every combination of
the swept overrides (`rlspec.sweep.expand`). Prints one table; writes OUT/eval.json and each one's samples beside it.

The engine is the spec's model (its preset or `model.path`) with the checkpoint's weights copied in, sampled as a
run's eval samples (`rlspec.evaluation.runner`): a run's eval of step N and this command on its step_N agree.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..spec import SpecError
from ..sweep import SUMMARY as SWEEP_SUMMARY
from .data import build_eval_set, check_eval_data


@dataclass
class Target:
    """One thing to evaluate: a checkpoint directory (None: the spec's own model, `--model`), its label in the table
    and its file names, and the overrides of the sweep job that trained it (`--checkpoints` of a sweep's OUT)."""

    label: str
    path: Optional[Path]
    job_overrides: tuple[str, ...] = ()


def targets(checkpoints: Sequence[str], run: str | None, model: str | None, sweep: bool = False) -> list[Target]:
    """Each thing to evaluate (`--checkpoint` given as `a,b` under `-m` too: the checkpoints are a sweep axis)."""
    from ..runtime.checkpoints import STATE_FILE

    chosen = [bool(checkpoints), run is not None, model is not None]
    if sum(chosen) != 1:
        raise SpecError("--checkpoint", "name one kind of thing to evaluate", "give --checkpoint DIR (repeatable), "
                        "--checkpoints OUT (every checkpoint of the run in OUT) or --model DIR (a local HF model)")
    if model is not None:
        return [Target(Path(model).name or "model", None)]
    if run is not None:
        return _run_targets(Path(run))
    given = [p for c in checkpoints for p in (c.split(",") if sweep else [c]) if p]
    for name in given:
        path = Path(name)
        if not (path / STATE_FILE).is_file() or not any(path.glob("*.safetensors")):
            raise SpecError("--checkpoint", f"{name} is not a completed checkpoint (no {STATE_FILE} or no "
                            "*.safetensors)", "give OUT/checkpoints/step_NNNNNN of a run, or --model DIR for a HF model")
    paths = [Path(p) for p in given]
    return [Target(f"{p.parent.parent.name}/{p.name}" if len(paths) > 1 else p.name, p) for p in paths]


def _run_targets(out: Path) -> list[Target]:
    """Every completed checkpoint of the run in `out`, or of every job of the sweep in `out` (`rlspec run -m`), each
    with its job's overrides."""
    from ..runtime.checkpoints import STATE_FILE, Checkpoints

    if (out / "checkpoints").is_dir() or not (out / SWEEP_SUMMARY).is_file():
        root = out / "checkpoints" if (out / "checkpoints").is_dir() else out
        found = [Target(p.name, p) for p in Checkpoints(root, 0, True).completed()]
    else:
        jobs = sorted((d for d in out.iterdir() if (d / "overrides.json").is_file()), key=lambda d: int(d.name))
        found = [Target(f"{job.name}/{p.name}", p, tuple(json.loads((job / "overrides.json").read_text())))
                 for job in jobs for p in Checkpoints(job / "checkpoints", 0, True).completed()]
    if not found:
        raise SpecError("--checkpoints", f"{out} holds no completed checkpoint (checkpoints/step_*/{STATE_FILE}, or "
                        f"<n>/checkpoints/step_*/{STATE_FILE} of a sweep)",
                        "give the --out directory of a run (or of a sweep) that saved checkpoints")
    return found


@dataclass
class Job:
    """One spec (the command's overrides, a sweep's combination of them) and the targets scored with it."""

    overrides: list[str]
    swept: list[str]
    targets: list[Target]
    plan: object
    combination: int
    """Its index among the sweep's combinations (its samples go to OUT/<combination>/ when there are several)."""


def evaluate(spec_path: str, overrides: Sequence[str] = (), backend: str | None = None,
             checkpoints: Sequence[str] = (), run: str | None = None, model: str | None = None,
             out: str | None = None, sweep: bool = False) -> Path:
    """Score each target (`targets`) with the spec, or, with `sweep` (`-m`), with every combination of the
    overrides' swept values (`rlspec.sweep.expand`); return the output directory (eval.json, the samples)."""
    from ..plan import build_plan, default_out_dir
    from ..sweep import expand
    from .runner import Evaluator, table

    chosen = targets(checkpoints, run, model, sweep)
    combos, swept_keys = expand(overrides) if sweep else ([list(overrides)], [])
    by_overrides: dict[tuple[str, ...], list[Target]] = {}  # the targets of each sweep job (one group otherwise)
    for target in chosen:
        by_overrides.setdefault(target.job_overrides, []).append(target)
    jobs = []
    for index, combo in enumerate(combos):  # every spec and every target's job overrides compiles, or nothing is scored
        swept = [o for o in combo if o.split("=", 1)[0] in swept_keys]
        for job_overrides, group in by_overrides.items():
            full = [*job_overrides, *combo, *([f"model.path={model}"] if model is not None else [])]
            try:
                plan, _ = build_plan(spec_path, full, backend)
                check_eval_data(plan.spec, force=True)
            except SpecError as err:
                named = " ".join([*job_overrides, *swept])
                raise SpecError(err.where, f"{err.problem} (with {named})" if named else err.problem, err.fix) from None
            jobs.append(Job(full, swept, group, plan, index))
    out_dir = Path(out) if out is not None else default_out_dir(spec_path, root="outputs/eval")
    if (out_dir / "eval.json").exists():
        raise SpecError("--out", f"{out_dir} already holds an eval (eval.json)", "choose a new --out directory")
    results: list[dict] = []
    history: list[tuple[str, dict]] = []
    for job in jobs:
        spec = job.plan.spec
        prefix = f"{job.combination}/" if len(combos) > 1 else ""  # a swept spec: each combination's samples apart
        evaluator = Evaluator(build_eval_set(spec, spec.model), spec.rollout.max_new_tokens, out_dir / prefix)
        engine = _engine(job.plan)
        for target in job.targets:
            step = None if target.path is None else _load(engine, target.path)
            metrics = evaluator.run(engine, -1 if step is None else step, label=target.label.replace("/", "_"))
            results.append({"target": str(target.path) if target.path is not None else model, "step": step,
                            "swept": job.swept, "overrides": job.overrides, "metrics": metrics})
            history.append((" ".join([*job.swept, target.label]), metrics))
            _write(out_dir, spec_path, overrides, results)  # after each: a failure loses nothing scored
        del engine, evaluator
        _release_memory()
    print(table(history))
    print(f"rlspec: eval written to {out_dir}/eval.json", file=sys.stderr)
    return out_dir


def _write(out_dir: Path, spec_path: str, overrides: Sequence[str], results: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = out_dir / "eval.json.tmp"
    report = {"spec": spec_path, "overrides": list(overrides), "results": results}
    staging.write_text(json.dumps(report, indent=2) + "\n")
    staging.replace(out_dir / "eval.json")


def _release_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _engine(plan):
    """The spec's rollout engine in this process, on the spec's device (the first GPU on CUDA)."""
    import torch

    from ..models.factory import load_model, load_tokenizer
    from ..rollout.hf import HFEngine

    spec = plan.spec
    if spec.hardware.num_threads:
        torch.set_num_threads(spec.hardware.num_threads)
    device = "cuda" if plan.placement.device == "cuda" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecError("hardware.device", "is cuda but this machine has no usable CUDA device", "set hardware.device=cpu")
    model = load_model(spec.model, spec.algorithm.seed, device).to(device).eval().requires_grad_(False)
    return HFEngine(model, load_tokenizer(spec.model), spec.rollout, device, spec.algorithm.micro_batch_size)


def _load(engine, path: Path) -> int:
    """Copy the checkpoint's weights into the engine's model; the step it was saved after."""
    from ..models.factory import copy_weights, read_safetensors_dir
    from ..runtime.checkpoints import step_of

    tensors = read_safetensors_dir(path)
    missing = set(engine.model.state_dict()) - set(tensors)
    tied = {"lm_head.weight"} if getattr(engine.model.config, "tie_word_embeddings", False) else set()
    try:
        if missing - tied:
            raise KeyError(f"it lacks {sorted(missing - tied)[:3]}")
        copy_weights(engine.model, tensors.items())
    except KeyError as err:
        raise SpecError("--checkpoint", f"{path} holds weights of another model than the spec's ({err})",
                        "evaluate it with the spec that trained it (its model preset or model.path)") from None
    return step_of(path)
