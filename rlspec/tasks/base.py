"""A task is a prompt source plus the reward functions that score its completions (`rlspec.tasks.rewards`).

Nothing here imports torch at import time: `rlspec plan` checks a task without it (`check_task`); the scores of a
batch become a tensor only when a run scores one.
"""

from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:  # torch is imported where rewards become a tensor: checking a task (`rlspec plan`) needs none
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


def score(task: Task, completions: list[str], prompts: list[Prompt], completion_ids: list[list[int]] | None = None) -> Scores:
    """Score every completion; a reward that raises or is not a finite number is recorded as an error.

    A task may score a whole batch at once (`score_batch(completions, prompts, completion_ids)` returning, per
    sample, a float or the exception that prevented it, plus counters), e.g. to send requests concurrently.
    """
    import torch

    batch_fn = getattr(task, "score_batch", None)
    if batch_fn is not None:
        results, metrics = batch_fn(completions, prompts, completion_ids)
    else:
        results, metrics = [_safe(task.reward, c, p) for c, p in zip(completions, prompts)], {}
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


class RecordOrder:
    """Which records a step draws: pass after pass over all of them, each pass in its own order (a permutation
    drawn from `seed` and the pass number; `seed` None keeps the file's order). Step `s` of `n` prompts takes
    draws `s * n` to `s * n + n - 1`, so a step's prompts depend on nothing but its number (resume, async)."""

    def __init__(self, count: int, seed: int | None) -> None:
        self.count, self.seed = count, seed
        self._orders: dict[int, list[int]] = {}

    def indices(self, step: int, n: int) -> list[int]:
        return [self._order(k // self.count)[k % self.count] for k in range(step * n, step * n + n)]

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.count))
            if self.seed is not None:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order, **{e: o for e, o in self._orders.items() if e == epoch - 1}}
        return self._orders[epoch]


class RewardTask:
    """Prompts (a list of records drawn by `RecordOrder`, or a generator `draw(rng)`) scored by `rewards` (a
    `rlspec.tasks.rewards.Rewards`, or None where the LLM judge scores: not imported here, which imports this module)."""

    def __init__(self, name: str, prompts: list[Prompt] | Callable[[random.Random], Prompt], rewards: Any,
                 seed: int, order_seed: int | None = None) -> None:
        self.name = name
        self._prompts = prompts
        self.rewards = rewards
        self._seed = seed
        self._order = None if callable(prompts) else RecordOrder(len(prompts), order_seed)

    def sample(self, step: int, n: int) -> list[Prompt]:
        if self._order is not None:
            return [self._prompts[i] for i in self._order.indices(step, n)]
        rng = random.Random(self._seed * 1_000_003 + step)
        return [self._prompts(rng) for _ in range(n)]

    def reward(self, completion: str, prompt: Prompt, completion_ids: list[int] | None = None) -> float:
        """The reward of one completion; raises what the reward function raised."""
        results, _ = self.score_batch([completion], [prompt], None if completion_ids is None else [completion_ids])
        if isinstance(results[0], BaseException):
            raise results[0]
        return results[0]

    def score_batch(self, completions: list[str], prompts: list[Prompt],
                    completion_ids: list[list[int]] | None = None) -> tuple[list, dict[str, float]]:
        return self.rewards.score_batch(completions, prompts, completion_ids)


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
