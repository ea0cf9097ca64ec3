"""Environments by name (`rollout.env.name`): `build_env_group(spec, num_envs)` returns an `EnvGroup`."""

from __future__ import annotations

from ..spec import EnvSpec, SpecError
from .base import EnvGroup, Observation, Transition


def check_env(spec: EnvSpec) -> None:
    """Build-time checks of the named environment (level exists, kwargs accepted); `SpecError` otherwise."""
    if spec.name == "minigrid":
        from .minigrid import check_env as check

        return check(spec)
    raise SpecError("rollout.env.name", f"unknown environment {spec.name!r}", "use rollout.env.name=minigrid")


def build_env_group(spec: EnvSpec, num_envs: int) -> EnvGroup:
    if spec.name == "minigrid":
        from .minigrid import MiniGridGroup

        return MiniGridGroup(spec, num_envs)
    raise SpecError("rollout.env.name", f"unknown environment {spec.name!r}", "use rollout.env.name=minigrid")


__all__ = ["EnvGroup", "Observation", "Transition", "build_env_group", "check_env"]
