"""`rlspec run` and `rlspec plan`: spec -> plan -> backend -> the shared loop."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import torch

from .backend import all_caps, backend_class, create_backend
from .checkpoints import Checkpoints, step_of
from .errors import SpecError
from .loop import train
from .metrics import read_metrics
from .models import check_model_spec
from .spec import RunPlan, compile_plan, load_spec
from .tasks import Task, build_task


def build_plan(spec_path: str, overrides: Sequence[str] = (), backend: str | None = None) -> tuple[RunPlan, Task]:
    """Compose, validate and compile; also build the task so its data file and reward kwargs are checked."""
    spec = load_spec(spec_path, overrides, backend)
    check_model_spec(spec.model)
    plan = compile_plan(spec, all_caps())
    task = build_task(plan.spec.rollout.task, plan.spec.algorithm.seed)
    if plan.spec.rollout.agent.enabled:
        from .agent import load_agent

        load_agent(plan.spec.rollout.agent)  # an agent that cannot be found is bad input, refused now
    return plan, task


def check_installed(caps) -> None:
    """Refuse, before anything is written, a backend whose packages are missing from this environment."""
    import importlib.util

    missing = [m for m in caps.requires if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecError("backend", f"backend {caps.name} needs {', '.join(missing)}, not installed in this environment",
                        caps.install_hint or f"install {', '.join(missing)}")


def default_out_dir(spec_path: str, root: str = "outputs") -> Path:
    return Path(root) / Path(spec_path).stem / time.strftime("%Y%m%d-%H%M%S")


def prepare_out_dir(out: Path, plan: RunPlan, resume: bool) -> int:
    """Create `out` (refusing to mix two runs in one directory); return the step to start from."""
    metrics = out / "metrics.jsonl"
    if not resume:
        if metrics.exists():
            raise SpecError("--out", f"{out} already holds a run (metrics.jsonl)",
                            "choose a new --out directory, or pass --resume to continue that run")
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(plan.to_json())
        return 0
    previous = out / "plan.json"
    if not previous.is_file():
        raise SpecError("--resume", f"{out} holds no run to resume (no plan.json)", "drop --resume to start a new run")
    if json.loads(previous.read_text())["spec"] != json.loads(plan.to_json())["spec"]:
        raise SpecError("--resume", f"the spec differs from the one {out} was started with",
                        "resume with the same spec and overrides, or start a new --out")
    latest = Checkpoints(out / "checkpoints", 0, True).latest()
    if latest is None:
        raise SpecError("--resume", f"{out} has no completed checkpoint", "start a new run instead")
    start = step_of(latest) + 1
    if metrics.exists():  # drop rows past the checkpoint; rewrite atomically
        kept = [row for row in read_metrics(metrics) if row["step"] < start]
        staging = out / "metrics.jsonl.tmp"
        staging.write_text("".join(json.dumps(row) + "\n" for row in kept))
        staging.replace(metrics)
    return start


def run(spec_path: str, overrides: Sequence[str] = (), backend_name: str | None = None, out: str | None = None,
        resume: bool = False, progress: bool | None = None) -> Path:
    """Train; return the output directory. Raises `SpecError` before writing anything for bad input."""
    plan, task = build_plan(spec_path, overrides, backend_name)
    check_installed(backend_class(plan.backend).caps)
    out_dir = Path(out) if out is not None else default_out_dir(spec_path)
    start_step = prepare_out_dir(out_dir, plan, resume)
    if plan.spec.hardware.num_threads:
        torch.set_num_threads(plan.spec.hardware.num_threads)
    from .sync import build_transport

    backend = create_backend(plan.backend)
    transport = build_transport(plan.sync_method, plan.spec.sync)
    try:
        backend.setup(plan)
        if start_step:
            backend.load(Checkpoints(out_dir / "checkpoints", 0, True).latest())
        pad_id = backend.rollout_engine().tokenizer.pad_token_id
        train(plan, backend, task, transport, out_dir, pad_id, start_step, progress)
    finally:
        transport.close()
        backend.shutdown()
    return out_dir
