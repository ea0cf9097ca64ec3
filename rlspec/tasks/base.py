"""A task is a prompt source plus a reward function; the spec's `reward_kwargs` reach the function.

`build_task` checks the kwargs against the reward function's signature up front, so a misspelt kwarg
is a spec error (exit 2) rather than a silently ignored setting.
"""

from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..spec import SpecError

if TYPE_CHECKING:  # torch is imported where rewards become a tensor: building a task (`rlspec plan`) needs none
    from torch import Tensor


@dataclass(frozen=True)
class Prompt:
    """One prompt and whatever its reward needs (e.g. the reference answer)."""

    text: str
    meta: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    name: str

    def sample(self, step: int, n: int) -> list[Prompt]:
        """The `n` prompts of rollout step `step` (deterministic for a given seed and step)."""

    def reward(self, completion: str, prompt: Prompt) -> float:
        """Scalar reward of one completion."""


RewardFn = Callable[..., float]


@dataclass
class Scores:
    """The rewards of one batch of completions, with the failures kept apart (never scored 0)."""

    rewards: Tensor
    """[N] float32; NaN where the reward could not be obtained."""
    errors: list[tuple[int, BaseException]]
    """(sample index, what went wrong) for each failed sample."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Counters the reward function reports for this batch (e.g. a judge's retries and fallbacks)."""

    @property
    def valid(self) -> Tensor:
        """[N] bool: samples whose reward was obtained."""
        import torch

        return torch.isfinite(self.rewards)


def score(task: Task, completions: list[str], prompts: list[Prompt]) -> Scores:
    """Score every completion; a reward that raises or is not a finite number is recorded as an error.

    A task may score a whole batch at once (`score_batch(completions, prompts)` returning, per sample,
    a float or the exception that prevented it, plus counters), e.g. to send requests concurrently.
    """
    batch_fn = getattr(task, "score_batch", None)
    if batch_fn is not None:
        results, metrics = batch_fn(completions, prompts)
    else:
        results, metrics = [_safe(task.reward, c, p) for c, p in zip(completions, prompts)], {}
    import torch

    rewards, errors = [], []
    for i, result in enumerate(results):
        if not isinstance(result, BaseException) and not math.isfinite(result):
            result = ValueError(f"the reward is {result}, not a finite number")
        if isinstance(result, BaseException):
            errors.append((i, result))
            rewards.append(math.nan)
        else:
            rewards.append(float(result))
    return Scores(torch.tensor(rewards, dtype=torch.float32), errors, dict(metrics))


def _safe(fn: Callable[..., float], *args) -> float | Exception:
    try:
        return float(fn(*args))
    except Exception as err:  # noqa: BLE001 - a failed reward is counted and its sample dropped, by the caller
        return err


class RewardTask:
    """A task made of a prompt source and a reward function `fn(completion, prompt, **reward_kwargs)`."""

    def __init__(self, name: str, prompts: list[Prompt] | Callable[[random.Random], Prompt], reward_fn: RewardFn,
                 reward_kwargs: dict[str, Any], seed: int) -> None:
        self.name = name
        self._prompts = prompts
        self._reward_fn = reward_fn
        self._reward_kwargs = dict(reward_kwargs)
        self._seed = seed

    def sample(self, step: int, n: int) -> list[Prompt]:
        rng = random.Random(self._seed * 1_000_003 + step)
        if callable(self._prompts):
            return [self._prompts(rng) for _ in range(n)]
        return [self._prompts[rng.randrange(len(self._prompts))] for _ in range(n)]

    def reward(self, completion: str, prompt: Prompt) -> float:
        return float(self._reward_fn(completion, prompt, **self._reward_kwargs))


def check_kwargs(fn: Callable, kwargs: dict[str, Any], key: str, skip: int) -> None:
    """Refuse kwargs `fn` does not accept (after its first `skip` positional parameters), naming `key`."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = {p.name for p in params}
    for name in kwargs:
        if name not in accepted:
            raise SpecError(f"{key}.{name}", f"{fn.__qualname__} takes no argument {name!r}",
                            f"accepted: {', '.join(sorted(accepted)) or '(none)'}")
    try:
        inspect.signature(fn).bind_partial(*([None] * skip), **kwargs)
    except TypeError as err:
        raise SpecError(key, str(err), "check the task's documented kwargs") from None
