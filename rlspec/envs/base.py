"""The environment interface: what an env-rollout needs from an environment, beside `rlspec.tasks`.

A GRPO group is `group_size` episodes from one seed, so the unit here is an `EnvGroup`: `num_envs` copies
of one environment reset from the same seed and stepped together (they diverge through the sampled
actions). One `Observation` per copy: an RGB image and a natural-language instruction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np


@dataclass
class Observation:
    image: np.ndarray
    """[H, W, 3] uint8 RGB."""
    instruction: str
    """What the agent is asked to do (BabyAI's mission)."""


@dataclass
class Transition:
    """The result of one action in one copy."""

    observation: Observation
    reward: float
    """Reward as the spec's `rollout.env.reward` defines it."""
    terminated: bool
    """The episode ended by the environment's rules (success, or a fatal mistake)."""
    truncated: bool
    """The episode hit the step limit."""
    success: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


class EnvGroup(Protocol):
    """`num_envs` copies of one environment, reset from one seed and stepped together."""

    num_envs: int
    num_actions: int
    """Discrete actions 0 .. num_actions - 1."""
    action_names: tuple[str, ...]
    max_steps: int
    """Steps after which an episode is truncated."""

    def reset(self, seed: int) -> list[Observation]:
        """Every copy from `seed` (so every copy starts identical); deterministic per seed."""

    def step(self, actions: Sequence[int]) -> list[Transition]:
        """One action per copy. A copy whose episode ended ignores its action until the next `reset`;
        its transition is meaningless. An exception means the whole group's step failed."""

    def close(self) -> None:
        """Release the copies."""
