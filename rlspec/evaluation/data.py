"""The eval set a spec names: prompts (held-out records of the task's data, another split or file read with the same
column mapping, or every copy_char prompt), the reward that scores them and the answer extractor of maj@k.

The eval data is read as a `TaskSpec` of its own (`eval_task_spec`: rollout.task with the eval's data, split, record
count and reward), so it takes every mapping rollout.task has; an error about it names the eval key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..spec import ModelSpec, Spec, SpecError, TaskSpec
from ..spec.evaluation import EVAL_SEED_OFFSET, answer_extractor, pass_ks
from ..tasks import Prompt, Task, copy_char


@dataclass
class EvalSet:
    """What one eval samples and how it scores it."""

    prompts: list[Prompt]
    scorer: Task
    """Scores completions (`rlspec.tasks.score`)."""
    k: int
    """Samples per prompt."""
    greedy: bool
    seed: int
    """The noise seed of sampled evals (the same at every eval)."""
    pass_ks: list[int]
    pass_threshold: Optional[float]
    """A sample passes when its reward is >= this; None with pass@k: a binary reward, passing when > 0."""
    extractor: Optional[Callable[[str], object]] = None
    """completion -> answer (maj@k); None: no maj@k."""
    sources: Optional[list[str]] = None
    """Each prompt's data source (eval.source_column); None: overall only."""


def uses_training_data(spec: Spec) -> bool:
    """Whether the eval reads the records training draws from (the task's own data and split)."""
    ev, task = spec.eval, spec.rollout.task
    return task.name != "copy_char" and ev.data_path is None and ev.split in (None, task.split)


def training_skip(spec: Spec) -> int:
    """Records at the start of the task's data that training never draws (the eval's held-out ones)."""
    return spec.eval.holdout_records if uses_training_data(spec) else 0


def eval_task_spec(spec: Spec) -> TaskSpec:
    """rollout.task as the eval reads it: its data, split and record count, and its reward."""
    ev, task = spec.eval, spec.rollout.task
    changes: dict = {"shuffle_seed": None, "num_records": 0}
    if task.name == "copy_char":
        if ev.data_path is not None:  # copy_char prompts from a file: a dataset whose records carry `letter`
            if not Path(ev.data_path).exists():
                raise SpecError("eval.data_path", f"{ev.data_path} does not exist", "give a local .jsonl or .parquet "
                                "file (columns prompt and letter for copy_char's reward)")
            changes.update(name="dataset", data_path=ev.data_path, dataset_kwargs={}, num_records=ev.max_prompts)
            if task.reward == "task" and not task.rewards:
                changes["reward"] = copy_char.REWARD
    elif uses_training_data(spec):
        if not ev.holdout_records:
            raise SpecError("eval.holdout_records", f"is 0 and the eval reads the training data ({task.data_path}, "
                            f"split {task.split}), so it would score the records training draws",
                            "set eval.holdout_records=N (the first N records become the eval set, training skips them), "
                            "or name held-out data: eval.split or eval.data_path")
        changes["num_records"] = ev.holdout_records
    else:
        if ev.holdout_records:
            raise SpecError("eval.holdout_records", "keeps records of the training data out, but the eval reads "
                            f"{ev.data_path or task.data_path} split {ev.split or task.split}",
                            "set eval.holdout_records=0, or unset eval.data_path and eval.split")
        if ev.data_path is not None:
            if not Path(ev.data_path).exists():
                raise SpecError("eval.data_path", f"{ev.data_path} does not exist", "give a local .jsonl or .parquet "
                                "file or a directory saved by datasets (relative to the current directory)")
            changes["data_path"] = ev.data_path
        if ev.split is not None:
            changes["split"] = ev.split
        changes["num_records"] = ev.max_prompts
    if ev.reward is not None:
        changes.update(reward=ev.reward, reward_kwargs=dict(ev.reward_kwargs), rewards=[])
    return _rekeyed(spec, lambda: dataclasses.replace(task, **changes))


def check_eval_data(spec: Spec, force: bool = False) -> None:
    """`rlspec plan`'s check (no torch, no records read): the eval data's columns and split, its reward functions and
    the answer extractor; nothing when the spec evaluates nothing (unless `force`: `rlspec eval`)."""
    ev = spec.eval
    if not force and not ev.enabled and not ev.holdout_records and ev.data_path is None and ev.split is None:
        return
    from ..tasks import check_task, data_columns

    if spec.rollout.env.name is not None:
        raise SpecError("eval", "scores text prompts; this spec's policy acts in rollout.env",
                        "unset eval.every_n_steps, eval.before_train and eval.at_end (and eval's data keys)")
    task_spec = eval_task_spec(spec)
    _rekeyed(spec, lambda: check_task(task_spec))
    if ev.source_column is not None:
        columns = _rekeyed(spec, lambda: data_columns(task_spec))
        if ev.source_column not in columns:
            raise SpecError("eval.source_column", f"the eval data has no column {ev.source_column!r}",
                            f"the columns are: {', '.join(sorted(columns))}")
    _extractor(spec)


def build_eval_set(spec: Spec, model: ModelSpec | None = None) -> EvalSet:
    """The eval set, its records read and its reward functions imported."""
    from ..tasks import build_task, task_prompts

    ev = spec.eval
    task_spec = eval_task_spec(spec)
    prompts = _rekeyed(spec, lambda: task_prompts(task_spec, model))
    if ev.max_prompts:
        prompts = prompts[:ev.max_prompts]
    scorer = _rekeyed(spec, lambda: build_task(task_spec, spec.algorithm.seed, model))
    sources = None
    if ev.source_column is not None:
        sources = [str(p.meta.get(ev.source_column)) for p in prompts]
    return EvalSet(prompts=prompts, scorer=scorer, k=ev.samples_per_prompt, greedy=ev.is_greedy,
                   seed=spec.algorithm.seed + EVAL_SEED_OFFSET, pass_ks=pass_ks(ev, spec.rollout.task),
                   pass_threshold=ev.pass_threshold, extractor=_extractor(spec), sources=sources)


def _extractor(spec: Spec):
    target = answer_extractor(spec.eval, spec.rollout.task)
    if target is None or spec.eval.samples_per_prompt < 2:
        return None
    from ..user_code import import_function

    return import_function(target, "eval.answer_extractor")


_MOVED = (("rollout.task.split", "eval.split", "split"), ("rollout.task.data_path", "eval.data_path", "data_path"),
          ("rollout.task.reward_kwargs", "eval.reward_kwargs", "reward"), ("rollout.task.reward", "eval.reward", "reward"))


def _rekeyed(spec: Spec, fn):
    """`fn()`, an error about a rollout.task key that the eval replaced renamed to the eval's key."""
    try:
        return fn()
    except SpecError as err:
        for old, new, field in _MOVED:
            if err.where.startswith(old) and getattr(spec.eval, field) is not None:
                raise SpecError(new + err.where[len(old):], err.problem, err.fix) from None
        if err.where.startswith("rollout.task.") and spec.eval.data_path is not None:  # e.g. a column the reward reads
            raise SpecError("eval.data_path", f"{err.where}: {err.problem}", err.fix) from None
        raise
