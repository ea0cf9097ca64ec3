"""Reward functions named in the spec (`module:function` or `path/to/file.py:function`), each with a weight.

A function declares what it reads by its parameter names and receives only those (everything, with `**kwargs`):
`prompt` (the text the policy was given), `completion` (the sampled text), `completion_ids` (its token ids),
every column of the prompt's record under the column's name (`answer` too, with `rollout.task.answer_column`),
and the spec's kwargs for it. Its form is read from its signature:

- one sample: a parameter `completion`; returns a float;
- a batch: a parameter `completions`; every argument is then a list with one entry per sample (`prompts`,
  `completions`, `completion_ids`, each column), except the spec's kwargs; returns a list of floats;
- either may be `async def`: the samples of a step are then awaited concurrently, on one event loop kept for the
  whole run (a client or semaphore the function's module creates keeps working from step to step).

The reward of a sample is the weighted sum of its functions' values. A function that raises, or returns something
that is not a finite number, fails the sample: it is counted in `reward/errors` and dropped (`rlspec.core.step`);
the first failure of a run is printed with its traceback (the run log keeps it). With `rollout.task.rewards`, each
function's mean over the samples it scored is logged as `reward/<name>/mean`.
"""

from __future__ import annotations

import inspect
import math
import sys
import traceback
import typing
from dataclasses import dataclass
from typing import Any, Callable

from ..spec import SpecError, TaskSpec
from ..user_code import import_function
from .base import Prompt

SAMPLE_ARGS = ("prompt", "completion", "completion_ids")
BATCH_ARGS = ("prompts", "completions", "completion_ids")


@dataclass
class RewardFunction:
    """One resolved reward function: how to call it and what its value weighs."""

    name: str
    fn: Callable
    weight: float
    kwargs: dict[str, Any]
    batched: bool
    is_async: bool
    accepts: frozenset[str] | None
    """The argument names it takes; None: any (it has **kwargs)."""

    def call_args(self, args: dict[str, Any]) -> dict[str, Any]:
        args = {**args, **self.kwargs}
        return args if self.accepts is None else {k: v for k, v in args.items() if k in self.accepts}


def resolve(target: str, kwargs: dict[str, Any], weight: float, name: str | None, columns: set[str], where: str,
            kwargs_key: str) -> RewardFunction:
    """Import `target` and check it (`reward_function`)."""
    return reward_function(import_function(target, where), kwargs, weight, name, columns, where, kwargs_key, target)


def reward_function(fn: Callable, kwargs: dict[str, Any] | None = None, weight: float = 1.0, name: str | None = None,
                    columns: set[str] = frozenset(), where: str = "rollout.task.reward",
                    kwargs_key: str = "rollout.task.reward_kwargs", target: str | None = None) -> RewardFunction:
    """Check, without calling it, that every argument `fn` requires will be there (`columns`: the record's) and every
    kwarg is one it takes (with an allowed value where its annotation is a `Literal`); say how to call it."""
    target = target or fn.__qualname__
    kwargs = kwargs or {}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise SpecError(where, f"{target} has no signature Python can read", "name a plain Python function") from None
    batched, single = "completions" in params, "completion" in params
    if batched == single:
        raise SpecError(where, f"{target} takes {'both' if batched else 'neither'} `completion` (one sample) "
                        f"{'and' if batched else 'nor'} `completions` (a batch of samples)",
                        "name its parameter completion to score one sample, or completions to score a list of them "
                        "(docs/data_and_rewards.md)")
    provided = {*(BATCH_ARGS if batched else SAMPLE_ARGS), *columns}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key, value in kwargs.items():
        if key not in params and not var_kw:
            raise SpecError(f"{kwargs_key}.{key}", f"{target} takes no argument {key!r}",
                            f"accepted: {', '.join(p for p in params if p not in provided) or '(none)'} "
                            f"(on the command line, ~{kwargs_key}.{key} drops it)")
        if key in provided:
            what = "a column of the data" if key in columns else "an argument rlspec passes"
            raise SpecError(f"{kwargs_key}.{key}", f"{key!r} is also {what}", "rename the parameter and the kwarg")
        _check_literal(fn, key, value, f"{kwargs_key}.{key}")
    for param in params.values():
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise SpecError(where, f"{target}'s parameter {param.name!r} is positional-only",
                            "arguments are passed by name; drop the '/'")
        required = param.default is inspect.Parameter.empty and param.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        if required and param.name not in provided and param.name not in kwargs:
            raise SpecError(where, f"{target} needs the argument {param.name!r}, which is neither a column of the data "
                            f"({', '.join(sorted(columns)) or 'none'}) nor one rlspec passes "
                            f"({', '.join(BATCH_ARGS if batched else SAMPLE_ARGS)})",
                            f"give it a default, set it in {kwargs_key}, or map a column to it")
    return RewardFunction(name or fn.__name__, fn, float(weight), dict(kwargs), batched,
                          inspect.iscoroutinefunction(fn), None if var_kw else frozenset(params))


def _check_literal(fn: Callable, key: str, value: Any, where: str) -> None:
    """A kwarg whose parameter is annotated `Literal[...]` must be one of its values."""
    try:
        hint = typing.get_type_hints(fn).get(key)
    except Exception:  # noqa: BLE001 - unresolvable annotations of user code: nothing to check
        return
    if typing.get_origin(hint) is typing.Literal and value not in typing.get_args(hint):
        choices = [str(c) for c in typing.get_args(hint)]
        raise SpecError(where, f"{value!r} is not accepted: it must be {', '.join(choices[:-1])} or {choices[-1]}"
                        if len(choices) > 1 else f"{value!r} is not accepted: it must be {choices[0]}",
                        f"see {fn.__module__}.{fn.__qualname__}")


def resolve_all(spec: TaskSpec, builtin: str | None, columns: set[str]) -> list[RewardFunction]:
    """The functions `spec` names (`rewards`, else `reward`; `reward: task` is the task's own function `builtin`),
    resolved and checked against the record's `columns`."""
    key = "rollout.task"
    if spec.rewards:
        functions = [resolve(r.function, r.kwargs, r.weight, r.name, columns, f"{key}.rewards[{i}].function",
                             f"{key}.rewards[{i}].kwargs") for i, r in enumerate(spec.rewards)]
        names = [f.name for f in functions]
        for i, name in enumerate(names):
            if names.index(name) != i:
                raise SpecError(f"{key}.rewards[{i}].name", f"two reward functions are named {name!r}",
                                "give one of them a name of its own (rollout.task.rewards[i].name)")
        return functions
    target = builtin if spec.reward == "task" else spec.reward
    return [resolve(target, spec.reward_kwargs, 1.0, None, columns, f"{key}.reward", f"{key}.reward_kwargs")]


class Rewards:
    """The weighted sum of reward functions over a batch; failures kept per sample, the first one printed."""

    def __init__(self, functions: list[RewardFunction], log_each: bool = False) -> None:
        self.functions = functions
        self.log_each = log_each
        self._reported = False
        self._loop = None  # the event loop of the async functions, made at their first call

    def _run(self, awaitable):
        """Await on this scorer's own loop: asyncio objects a function keeps between steps stay bound to it."""
        import asyncio  # here: its import is a tenth of what `rlspec plan` may take, and only async functions need it

        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(awaitable)

    def score_batch(self, completions: list[str], prompts: list[Prompt],
                    completion_ids: list[list[int]] | None = None) -> tuple[list, dict[str, float]]:
        """Per sample the weighted reward or the exception that failed it; `reward/<name>/mean` per function."""
        ids = completion_ids if completion_ids is not None else [[] for _ in completions]
        totals: list[float | BaseException] = [0.0] * len(completions)
        metrics: dict[str, float] = {}
        for function in self.functions:
            values = _values(function, completions, prompts, ids, self._run)
            scored = []
            for i, value in enumerate(values):
                if not isinstance(value, BaseException) and not math.isfinite(value):
                    value = ValueError(f"reward function {function.name} returned {value}, not a finite number")
                if isinstance(value, BaseException):
                    self._report(function, value)
                    if not isinstance(totals[i], BaseException):
                        totals[i] = value
                    continue
                scored.append(value)
                if not isinstance(totals[i], BaseException):
                    totals[i] += function.weight * value
            if self.log_each:
                metrics[f"reward/{function.name}/mean"] = sum(scored) / len(scored) if scored else math.nan
        return totals, metrics

    def _report(self, function: RewardFunction, error: BaseException) -> None:
        if self._reported:
            return
        self._reported = True
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        print(f"rlspec: reward function {function.name} failed on a sample; it is counted in reward/errors and the "
              "sample dropped (rollout.task.max_reward_error_rate bounds how many may fail). The first failure, later "
              f"ones are only counted:\n{trace}", file=sys.stderr, flush=True)


def _values(function: RewardFunction, completions: list[str], prompts: list[Prompt], ids: list[list[int]],
            run: Callable) -> list[float | BaseException]:
    """`function`'s value per sample (or what it raised), in either form; `run` awaits an async one."""
    if function.batched:
        columns = {key: [p.meta.get(key) for p in prompts] for key in prompts[0].meta} if prompts else {}
        args = function.call_args({**columns, "prompts": [p.text for p in prompts], "completions": completions,
                                   "completion_ids": ids})
        try:
            values = list(run(function.fn(**args)) if function.is_async else function.fn(**args))
        except Exception as err:  # noqa: BLE001 - a failed batch fails each of its samples
            return [err] * len(completions)
        if len(values) != len(completions):
            err = ValueError(f"reward function {function.name} returned {len(values)} values for {len(completions)} completions")
            return [err] * len(completions)
        return [_number(function, v) for v in values]
    calls = [function.call_args({**p.meta, "prompt": p.text, "completion": c, "completion_ids": i})
             for c, p, i in zip(completions, prompts, ids)]
    if function.is_async:
        return run(_gather(function.fn, calls))
    return [_one(function.fn, args) for args in calls]


def _number(function: RewardFunction, value: Any) -> float | BaseException:
    try:
        return float(value)
    except (TypeError, ValueError):
        return ValueError(f"reward function {function.name} returned {value!r} for a sample, not a number")


def _one(fn: Callable, args: dict[str, Any]) -> float | BaseException:
    try:
        return float(fn(**args))
    except Exception as err:  # noqa: BLE001 - a failed reward is counted and its sample dropped
        return err


async def _gather(fn: Callable, calls: list[dict[str, Any]]) -> list[float | BaseException]:
    import asyncio

    async def one(args):
        try:
            return float(await fn(**args))
        except Exception as err:  # noqa: BLE001 - as `_one`
            return err

    return list(await asyncio.gather(*(one(args) for args in calls)))
