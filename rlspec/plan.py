"""Spec file + overrides -> the checked `RunPlan` and its task: what `rlspec plan` prints and every command starts from.

Imports no torch: the compiler sees the backends through their registered `BackendCaps`, the model checks read files,
and tasks build without tensors, so a spec is validated in about a second (`tests/spec/test_fast_plan.py`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from .core.backend import all_caps
from .evaluation import check_eval_data, training_skip
from .models.checks import check_model_spec
from .runtime.loggers import check_loggers
from .spec import RunPlan, compile_plan, load_spec
from .tasks import Task, build_task, check_task


def build_plan(spec_path: str, overrides: Sequence[str] = (), backend: str | None = None,
               full: bool = True) -> tuple[RunPlan, Task | None]:
    """Compose, validate and compile; also build the task (its data read, its rewards imported) so that bad input
    is refused before anything runs.

    `full=False` is `rlspec plan`'s torch-free check: the task is checked, not built (its data's columns read,
    its reward functions imported: `rlspec.tasks.check_task`) and returned as None, and a `model.path`'s weights
    are not checked against its config (`rlspec.models.checks.check_model_spec`); the run makes both checks before
    it writes anything."""
    spec = load_spec(spec_path, overrides, backend)
    plan = compile_plan(spec, all_caps())
    check_model_spec(plan.spec.model, full)  # after the compiler has checked that model.path is a directory
    task_spec = plan.spec.rollout.task
    if full:
        task = build_task(task_spec, plan.spec.algorithm.seed, plan.spec.model, training_skip(plan.spec))
    else:
        check_task(task_spec)
        task = None
    check_eval_data(plan.spec)
    check_loggers(plan)
    if plan.spec.rollout.env.name is not None:
        from .envs import check_env

        check_env(plan.spec.rollout.env)
    if plan.spec.rollout.agent.enabled:
        from .agent import load_agent

        load_agent(plan.spec.rollout.agent)  # an agent that cannot be found is bad input, refused now
    return plan, task


def default_out_dir(spec_path: str, root: str = "outputs") -> Path:
    """Where a run (or a bench, a sweep) writes without `--out`: ROOT/<spec name>/<time>."""
    return Path(root) / Path(spec_path).stem / time.strftime("%Y%m%d-%H%M%S")
