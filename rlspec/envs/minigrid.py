"""MiniGrid / BabyAI levels as an `EnvGroup`: headless egocentric RGB views, batched with gymnasium's
`SyncVectorEnv`.

The observation is MiniGrid's 7x7-cell egocentric partial view rendered to RGB (`RGBImgPartialObsWrapper`,
`tile_size` pixels per cell: 56x56 at the default 8); the instruction is the level's mission. Actions are
MiniGrid's Discrete(7): left, right, forward, pickup, drop, toggle, done — or only the first
`rollout.env.num_actions` of them (3 for navigation levels, where the other four change nothing).

Reward (`rollout.env.reward`): `success` gives 1.0 when the episode ends in success, else 0.0; `minigrid`
keeps the level's own shaping, 1 - 0.9 * steps / max_steps on success, else 0.0. An episode that reaches
`max_steps` is truncated (reward 0).
"""

from __future__ import annotations

import contextlib
import io
from functools import partial
from typing import Sequence

import numpy as np

from ..spec import EnvSpec, SpecError
from .base import Observation, Transition

ACTION_NAMES = ("left", "right", "forward", "pickup", "drop", "toggle", "done")


def _gym():
    try:
        import gymnasium
        import minigrid  # noqa: F401 - registers the MiniGrid-* and BabyAI-* ids
    except ImportError as err:  # pragma: no cover - depends on the install
        raise SpecError("rollout.env.name", f"the minigrid environment needs minigrid and gymnasium ({err})",
                        "pip install 'rlspec[vla]'") from err
    return gymnasium


def make_env(spec: EnvSpec):
    """One wrapped MiniGrid env (no rendering window)."""
    gym = _gym()
    from minigrid.wrappers import RGBImgPartialObsWrapper

    kwargs = dict(spec.kwargs)
    if spec.max_steps:
        kwargs["max_steps"] = spec.max_steps
    return RGBImgPartialObsWrapper(gym.make(spec.level, **kwargs), tile_size=spec.tile_size)


def check_env(spec: EnvSpec) -> None:
    """Refuse an unknown level or kwargs the level does not take, before a run writes anything."""
    gym = _gym()
    if spec.level not in gym.registry:
        known = sorted(k for k in gym.registry if k.startswith(("MiniGrid-", "BabyAI-")))
        raise SpecError("rollout.env.level", f"{spec.level!r} is not a registered MiniGrid/BabyAI level",
                        f"use one of the {len(known)} registered, e.g. {', '.join(known[:4])}")
    try:
        env = make_env(spec)
    except TypeError as err:
        raise SpecError("rollout.env.kwargs", f"{spec.level} refused its keyword arguments: {err}",
                        "remove or rename them") from None
    available = int(env.action_space.n)
    env.close()
    if spec.num_actions > available:
        raise SpecError("rollout.env.num_actions", f"{spec.level} has {available} actions, asked for {spec.num_actions}",
                        f"set rollout.env.num_actions to at most {available} (0 keeps all)")


class MiniGridGroup:
    """`num_envs` copies of a MiniGrid level in one `SyncVectorEnv`."""

    action_names = ACTION_NAMES

    def __init__(self, spec: EnvSpec, num_envs: int) -> None:
        gym = _gym()
        self.spec = spec
        self.num_envs = num_envs
        self.vector = gym.vector.SyncVectorEnv([partial(make_env, spec) for _ in range(num_envs)])
        self.num_actions = spec.num_actions or int(self.vector.single_action_space.n)
        self.max_steps = int(self.vector.envs[0].unwrapped.max_steps)

    def reset(self, seed: int) -> list[Observation]:
        with _quiet():
            obs, _ = self.vector.reset(seed=[seed] * self.num_envs)
        return self._observations(obs)

    def step(self, actions: Sequence[int]) -> list[Transition]:
        with _quiet():
            obs, rewards, terminated, truncated, infos = self.vector.step(np.asarray(actions, dtype=np.int64))
        out = []
        for i, observation in enumerate(self._observations(obs)):
            raw = float(rewards[i])
            success = bool(terminated[i]) and raw > 0
            reward = (1.0 if success else 0.0) if self.spec.reward == "success" else raw
            out.append(Transition(observation, reward, bool(terminated[i]), bool(truncated[i]) and not terminated[i], success))
        return out

    def close(self) -> None:
        self.vector.close()

    def _observations(self, obs) -> list[Observation]:
        return [Observation(np.asarray(obs["image"][i]), str(obs["mission"][i])) for i in range(self.num_envs)]


@contextlib.contextmanager
def _quiet():
    """BabyAI's level generators print every rejected layout ("Sampling rejected: ..."); keep the run's output clean."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield
