"""Tasks by name: prompts + reward function. `build_task(spec.rollout.task, seed)` returns a `Task`.

With `rollout.task.reward: llm_judge` the task's prompts are kept and a remote judge scores them
(`rlspec.tasks.llm_judge`).
"""

from __future__ import annotations

from ..spec import SpecError, TaskSpec
from . import copy_char, gsm8k
from .base import Prompt, RewardTask, Scores, Task, check_kwargs, score

TASK_NAMES = ("copy_char", "gsm8k")


def build_task(spec: TaskSpec, seed: int) -> Task:
    """The task named by `spec`, with its dataset and reward kwargs (or its judge settings) checked."""
    task = _named_task(spec, seed)
    if spec.reward == "llm_judge":
        from .llm_judge import build_judge_task

        return build_judge_task(task, spec.judge, seed)
    return task


def _named_task(spec: TaskSpec, seed: int) -> RewardTask:
    key = "rollout.task"
    if spec.name == "copy_char":
        check_kwargs(copy_char.make_prompt_source, spec.dataset_kwargs, f"{key}.dataset_kwargs", skip=0)
        check_kwargs(copy_char.reward, spec.reward_kwargs, f"{key}.reward_kwargs", skip=2)
        try:
            source = copy_char.make_prompt_source(**spec.dataset_kwargs)
        except ValueError as err:
            raise SpecError(f"{key}.dataset_kwargs", str(err), "see rlspec.tasks.copy_char") from None
        return _dry_run(RewardTask("copy_char", source, copy_char.reward, spec.reward_kwargs, seed), f"{key}.reward_kwargs")
    if spec.name == "gsm8k":
        if spec.data_path is None:
            raise SpecError(f"{key}.data_path", "the gsm8k task needs a data file",
                            "set rollout.task.data_path to a local .jsonl/.parquet (examples/data/gsm8k_sample.jsonl)")
        if spec.dataset_kwargs:
            raise SpecError(f"{key}.dataset_kwargs", "the gsm8k task takes no dataset kwargs", "remove them")
        check_kwargs(gsm8k.reward, spec.reward_kwargs, f"{key}.reward_kwargs", skip=2)
        task = RewardTask("gsm8k", gsm8k.to_prompts(gsm8k.load_records(spec.data_path)), gsm8k.reward,
                          spec.reward_kwargs, seed)
        return _dry_run(task, f"{key}.reward_kwargs")
    raise SpecError(f"{key}.name", f"unknown task {spec.name!r}", f"use one of: {', '.join(TASK_NAMES)}")


def _dry_run(task: RewardTask, key: str) -> RewardTask:
    """Score one empty completion so a bad kwarg value fails now, as a spec error, not mid-run."""
    prompt = task.sample(0, 1)[0]
    try:
        task.reward("", prompt)
    except (ValueError, TypeError) as err:
        raise SpecError(key, f"the reward function refused its kwargs: {err}", "see the task's docstring") from None
    return task


__all__ = ["Prompt", "Scores", "Task", "TASK_NAMES", "build_task", "score"]
