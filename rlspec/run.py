"""`rlspec run`: spec -> plan (`rlspec.plan`) -> backend -> the shared loop."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Sequence

import torch

from .core.backend import backend_class, create_backend
from .core.loop import train
from .errors import SpecError
from .evaluation import build_eval_set
from .evaluation.runner import Evaluator, table as eval_table
from .models.base import pad_token_id
from .plan import build_plan, default_out_dir  # noqa: F401 - where scripts and tests have found them
from .runtime.checkpoints import Checkpoints, check_resumable, resume_warnings
from .runtime.loggers import start_loggers
from .runtime.metrics import read_metrics
from .runtime.monitor import RUN_LOG, RunLog, RunMonitor
from .spec import RESUMABLE_CHANGES, RunPlan, resume_changes


def check_installed(caps) -> None:
    """Refuse, before anything is written, a backend whose packages are missing from this environment."""
    import importlib.util

    missing = [m for m in caps.requires if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecError("backend", f"backend {caps.name} needs {', '.join(missing)}, not installed in this environment",
                        caps.install_hint or f"install {', '.join(missing)}")


def check_machine(plan: RunPlan) -> None:
    """What the plan cannot know: is there CUDA (and enough GPUs) where the ranks will run? Checked only
    when they run on this machine (no `hardware.ray_address`); a cluster's GPUs are the backend's to find."""
    if plan.placement.device != "cuda" or plan.spec.hardware.ray_address is not None:
        return
    if not torch.cuda.is_available():
        raise SpecError("hardware.device", "hardware.device=cuda but this machine has no usable CUDA device "
                        "(torch.cuda.is_available() is False)", "set hardware.device=cpu, or run where a GPU is visible")
    rollout = plan.spec.rollout
    # Rollout servers a single-process backend joins bring their own GPUs, maybe on other machines.
    joined = backend_class(plan.backend).caps.single_process and (rollout.server_url is not None or bool(rollout.server_urls))
    needed = len(plan.placement.trainer_devices) if joined else plan.placement.num_gpus
    if torch.cuda.device_count() < needed:
        raise SpecError("hardware.num_trainer_ranks", f"the plan needs {needed} GPUs, this machine "
                        f"shows {torch.cuda.device_count()}", "lower hardware.num_trainer_ranks / num_rollout_engines, "
                        "or set hardware.ray_address to a cluster")


def create_out_dir(out: Path) -> list[Path]:
    """`mkdir -p out`; return the directories it created (to remove again if the run is refused later)."""
    missing = [p for p in (out, *out.parents) if not p.exists()][::-1]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        remove_created(missing)
        raise SpecError("--out", f"cannot create {out}: {err.strerror or err}",
                        "choose a directory this user can create and write to") from None
    return missing


def remove_created(created: list[Path], files: Sequence[Path] = ()) -> None:
    """Undo a refused run's outputs: `files`, then the directories it created if they are empty."""
    for file in files:
        file.unlink(missing_ok=True)
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            break


def prepare_out_dir(out: Path, plan: RunPlan, resume: bool) -> tuple[int, list[Path]]:
    """Create `out` (refusing to mix two runs in one directory); return the step to start from and the
    directories created."""
    metrics = out / "metrics.jsonl"
    if not resume:
        if metrics.exists():
            raise SpecError("--out", f"{out} already holds a run (metrics.jsonl)",
                            "choose a new --out directory, or pass --resume to continue that run")
        if out.exists() and not out.is_dir():
            raise SpecError("--out", f"{out} is a file", "choose a directory path for --out")
        created = create_out_dir(out)
        try:
            (out / "plan.json").write_text(plan.to_json())
        except OSError as err:
            remove_created(created, [out / "plan.json"])
            raise SpecError("--out", f"cannot write in {out}: {err.strerror or err}", "choose a writable --out") from None
        return 0, created
    previous = out / "plan.json"
    if not previous.is_file():
        raise SpecError("--resume", f"{out} holds no run to resume (no plan.json)", "drop --resume to start a new run")
    try:
        started = json.loads(previous.read_text())["spec"]
        now = json.loads(plan.to_json())["spec"]
        _, refused = resume_changes(started, now)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise SpecError("--resume", f"{previous} is unreadable ({type(err).__name__})", "start a new --out") from None
    if refused:
        raise resume_refused(refused, started, now, out)
    if plan.spec.model.lora.r and now["backend"] != started.get("backend", now["backend"]):
        raise SpecError("backend", f"is {now['backend']!r} now but {started['backend']!r} in the run {out} resumes; "
                        "a LoRA run's optimizer state is saved in its backend's own layout",
                        f"resume with --backend {started['backend']}, or start a new --out")
    latest = Checkpoints(out / "checkpoints", 0, True).latest()
    if latest is None:
        raise SpecError("--resume", f"{out} has no completed checkpoint", "start a new run instead")
    start = check_resumable(latest, plan.spec.model) + 1
    staging = out / "plan.json.tmp"  # the plan now in force (steps, cadence, timeouts may have changed)
    staging.write_text(plan.to_json())
    staging.replace(previous)
    if metrics.exists():  # drop rows past the checkpoint; rewrite atomically
        kept = [row for row in read_metrics(metrics) if row["step"] < start]
        staging = out / "metrics.jsonl.tmp"
        staging.write_text("".join(json.dumps(row) + "\n" for row in kept))
        staging.replace(metrics)
    return start, []


def record_resume_warnings(out: Path, warnings: list[str]) -> list[str]:
    """Keep `warnings` (`resume_warnings`) in OUT/plan.json as `resume_warnings`, the plan now in force."""
    if warnings:
        plan = json.loads((out / "plan.json").read_text())
        plan["resume_warnings"] = warnings
        staging = out / "plan.json.tmp"
        staging.write_text(json.dumps(plan, indent=2))
        staging.replace(out / "plan.json")
    return warnings


def resume_refused(keys: list[str], started: dict, now: dict, out: Path) -> SpecError:
    """The `SpecError` naming the first field that changed the math since the run in `out` started."""
    key = keys[0]
    was, new = _lookup(started, key), _lookup(now, key)
    others = f" (also changed: {', '.join(keys[1:])})" if len(keys) > 1 else ""
    return SpecError(key, f"is {new!r} now but {was!r} in the run {out} resumes{others}; it changes what a step "
                     "computes, so --resume keeps it", f"resume with {key}={json.dumps(was)}, or start a new --out "
                     f"(--resume may change only the {len(RESUMABLE_CHANGES)} fields that do not change the math — "
                     "steps, checkpointing, timeouts, where the trainer runs: spec.RESUMABLE_CHANGES)")


def _lookup(tree: dict, key: str):
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def run(spec_path: str, overrides: Sequence[str] = (), backend_name: str | None = None, out: str | None = None,
        resume: bool = False, progress: bool | None = None) -> Path:
    """Train; return the output directory. Raises `SpecError` before writing anything for bad input."""
    plan, task = build_plan(spec_path, overrides, backend_name)
    eval_set = build_eval_set(plan.spec, plan.spec.model) if plan.spec.eval.enabled else None
    caps = backend_class(plan.backend).caps
    check_installed(caps)
    check_machine(plan)
    out_dir = Path(out) if out is not None else default_out_dir(spec_path)
    start_step, created = prepare_out_dir(out_dir, plan, resume)
    latest = Checkpoints(out_dir / "checkpoints", 0, True).latest() if start_step else None
    changed = record_resume_warnings(out_dir, resume_warnings(latest, plan, caps)) if latest else []
    if plan.spec.hardware.num_threads:
        torch.set_num_threads(plan.spec.hardware.num_threads)
    if not torch.cuda.is_available():
        # What DeepSpeed detects here anyway, said up front: transformers' save_pretrained imports it where it is
        # installed, and it would log a WARNING about falling back to the CPU into every run's output.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from .sync import build_transport

    backend = create_backend(plan.backend)
    transport = build_transport(plan.sync_method, plan.spec.sync)
    set_up, loggers, monitor = False, None, None
    try:
        with RunLog(out_dir / RUN_LOG):
            for warning in changed:  # inside the run log
                print(f"rlspec: WARNING: {warning}", file=sys.stderr, flush=True)
            try:
                loggers = start_loggers(plan, out_dir, start_step)  # one that cannot start: SpecError, before setup
                backend.setup(plan)
                set_up = True
                if latest is not None:
                    backend.load(latest)
                pad_id = pad_token_id(backend.rollout_engine().tokenizer)
                evaluator = None if eval_set is None else \
                    Evaluator(eval_set, plan.spec.rollout.max_new_tokens, out_dir / "eval")
                with RunMonitor(plan, out_dir, getattr(backend, "actors", tuple)) as monitor:
                    train(plan, backend, task, transport, out_dir, pad_id, start_step, progress, monitor, loggers,
                          evaluator)
                if evaluator is not None and evaluator.history:
                    print(f"rlspec: eval ({out_dir / 'eval'})\n{eval_table(evaluator.history)}", file=sys.stderr)
            finally:
                failed = sys.exc_info()[0] is not None
                if loggers is not None:
                    loggers.close(failed, out_dir / "metrics.jsonl")
                # A failed run of Ray actors kills them first: closing a transport calls into them (cuda_ipc's
                # release runs in the trainer ranks), and a rank stopped or stuck in a collective never answers. On
                # one H200 a rank stopped with SIGSTOP left the run hung here after its stall, past the stall's
                # hard exit. Otherwise the transport closes first (the engine lets go of mapped memory first; a
                # joined rollout server is told to leave the group while the backend's client still reaches it).
                kill_first = failed and hasattr(backend, "actors")
                try:
                    for close in (backend.shutdown, transport.close) if kill_first else (transport.close,
                                                                                          backend.shutdown):
                        close()
                finally:
                    if monitor is not None:
                        monitor.disarm()
    except SpecError:
        if not set_up and not resume:  # bad input the backend found: leave nothing behind
            remove_created(created, [out_dir / "plan.json", out_dir / RUN_LOG])
        raise
    return out_dir
