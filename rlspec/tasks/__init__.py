"""Tasks: prompts + the reward functions that score them (`rlspec.tasks.rewards`).

`copy_char` draws synthetic prompts; `dataset` reads local data with a column mapping (`rlspec.tasks.data`);
`gsm8k` is `dataset` with its own prompt template and reward. Every reward, built-in or the user's, is a function
reached by `module:function` or `path/to/file.py:function`. With `rollout.task.reward: llm_judge` the task's
prompts are kept and a remote judge scores them (`rlspec.tasks.llm_judge`).

`check_task` is what `rlspec plan` runs: it reads column names and imports the reward functions, without
importing torch, transformers or `datasets`. `build_task` reads the records when a run starts.
"""

from __future__ import annotations

from typing import Callable

from ..spec import ModelSpec, SpecError, TaskSpec
from ..spec.sources import TASK_NAMES
from . import copy_char, data, gsm8k
from .base import Prompt, RewardTask, Scores, Task, check_kwargs, score
from .rewards import Rewards, resolve_all

COPY_CHAR_COLUMNS = {"letter"}
"""What a copy_char prompt hands its reward besides prompt and completion."""
BUILTIN_REWARDS = {"copy_char": copy_char.REWARD, "gsm8k": gsm8k.REWARD}
"""What `rollout.task.reward: task` names for each built-in task (`dataset` has no reward of its own)."""


def check_task(spec: TaskSpec) -> None:
    """Refuse, cheaply, a task that cannot run: data that is missing, a column the mapping names that the data does
    not have, a reward function that cannot be imported or whose arguments would not be there."""
    _checked(spec)


def build_task(spec: TaskSpec, seed: int, model: ModelSpec | None = None, skip_records: int = 0) -> Task:
    """The task `spec` names, its records read (but the first `skip_records`: an eval's held-out ones); chat-format
    prompts are rendered with `model`'s tokenizer. `seed` (algorithm.seed) draws copy_char's prompts and, unless
    `rollout.task.shuffle_seed` is set, the record order."""
    functions = _checked(spec)
    rewards = Rewards(functions, log_each=bool(spec.rewards)) if functions else None  # none: the judge scores
    if spec.name == "copy_char":
        task = RewardTask("copy_char", _copy_char_source(spec), rewards, seed)
    else:
        prompts = data.to_prompts(data.load_records(spec, skip_records), spec, _template(spec), _renderer(model))
        task = RewardTask(spec.name, prompts, rewards, seed, order_seed(spec, seed))
    if spec.reward == "llm_judge":
        from .llm_judge import build_judge_task

        return build_judge_task(task, spec.judge, seed)
    return task


def order_seed(spec: TaskSpec, seed: int) -> int | None:
    """The seed of the record order (`rlspec.tasks.base.RecordOrder`): `rollout.task.shuffle_seed`, or where it is null
    `seed` (algorithm.seed); None keeps the file's order (`rollout.task.shuffle=false`)."""
    if not spec.shuffle:
        return None
    return seed if spec.shuffle_seed is None else spec.shuffle_seed


def task_prompts(spec: TaskSpec, model: ModelSpec | None = None) -> list[Prompt]:
    """Every prompt of the task, in order (an eval set): the records' prompts; copy_char: each letter once."""
    if spec.name == "copy_char":
        _copy_char_source(spec)
        return copy_char.every_prompt(**spec.dataset_kwargs)
    return data.to_prompts(data.load_records(spec), spec, _template(spec), _renderer(model))


def data_columns(spec: TaskSpec) -> set[str]:
    """The columns each of the task's prompts carries to its reward (read without loading the data)."""
    if spec.name == "copy_char":
        return set(COPY_CHAR_COLUMNS)
    return set(data.data_columns(spec))


def _checked(spec: TaskSpec) -> list:
    """The reward functions, resolved against the columns the task's prompts will carry (none for the judge)."""
    if spec.name == "copy_char":
        _copy_char_source(spec)
        columns = COPY_CHAR_COLUMNS
    else:
        if spec.dataset_kwargs:
            raise SpecError("rollout.task.dataset_kwargs", f"only copy_char takes dataset kwargs, not {spec.name}",
                            "map the data's columns with rollout.task.prompt_column and answer_column instead")
        names = data.data_columns(spec)
        data.check_mapping(spec, names, _template(spec))
        columns = {*names, *(("answer",) if spec.answer_column is not None else ())}
    if spec.reward == "llm_judge":
        return []
    return resolve_all(spec, BUILTIN_REWARDS.get(spec.name), columns)


def _copy_char_source(spec: TaskSpec):
    check_kwargs(copy_char.make_prompt_source, spec.dataset_kwargs, "rollout.task.dataset_kwargs", skip=0)
    try:
        return copy_char.make_prompt_source(**spec.dataset_kwargs)
    except ValueError as err:
        raise SpecError("rollout.task.dataset_kwargs", str(err), "see rlspec.tasks.copy_char") from None


def _template(spec: TaskSpec) -> str | None:
    if spec.prompt_template is None and spec.name == "gsm8k":
        return gsm8k.PROMPT_TEMPLATE
    return spec.prompt_template


def _renderer(model: ModelSpec | None) -> Callable[[list], str]:
    """Renders chat messages with the model's tokenizer, loaded at the first chat prompt (text data needs none)."""
    loaded: list[Callable[[list], str]] = []

    def render(messages: list) -> str:
        if not loaded:
            from ..models.factory import load_tokenizer

            loaded.append(data.chat_renderer(load_tokenizer(model if model is not None else ModelSpec())))
        return loaded[0](messages)

    return render


__all__ = ["Prompt", "Scores", "Task", "TASK_NAMES", "build_task", "check_task", "data_columns", "score", "task_prompts"]
