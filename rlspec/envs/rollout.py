"""Environment rollouts: episodes of a vision-language-action policy become one step's `TrainBatch`.

Per step, `prompts_per_step` seeds each start one group of `group_size` episodes (every copy reset from
the same seed). At every env step the policy sees the current image and the instruction (no history: the
MiniGrid view is egocentric and the levels used here are solvable from it) and samples one action token
from the softmax over the action ids at the rollout temperature — the same distribution the trainer's
log-probs use (`rlspec.core.policy.sequence_logprobs` with `TrainBatch.action_vocab`).

Training rows are per step (OpenVLA-RL / vlarl style): one row = prompt (image tokens + instruction) +
the action token, carrying its episode's advantage (scaled so that `algorithm.loss_agg` treats an episode as the sequence, see
`episode_weights`). Per-step rows keep every row as short as a single
observation (one image each), where one multi-turn row per episode would hold up to `max_steps` images
and grow attention with the episode.

Rows are padded with empty rows (no loss token, advantage 0) to a multiple of
`updates_per_batch * num_trainer_ranks`, so a step's rows split evenly into mini-batches and ranks; empty
rows change no gradient and no normaliser (`LossNorm` counts sequences with a loss token).

Counted, never silent: `env/truncated` (episodes that hit the step limit; reward 0) and `env/errors`
(episodes lost because their group's env raised; the whole group is dropped from training, since its
advantages would compare against missing episodes, and the error is logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from ..core.batch import TrainBatch
from ..core.grpo import group_advantages
from ..core.policy import forward_logits
from ..errors import RunError
from ..models.base import pad_token_id
from ..models.vla import PromptEncoder, action_token_ids
from ..rollout.sampling import top_p_filter
from ..runtime.metrics import PhaseTimer
from ..spec import RunPlan
from . import build_env_group
from .base import Observation

log = logging.getLogger(__name__)


@dataclass
class Episode:
    prompts: list[list[int]] = field(default_factory=list)
    pixel_values: list[Tensor] = field(default_factory=list)
    actions: list[int] = field(default_factory=list)
    """Action indices (0 .. num_actions - 1)."""
    reward: float = 0.0
    success: bool = False
    truncated: bool = False
    done: bool = False


@torch.no_grad()
def sample_actions(model: torch.nn.Module, prompts: list[list[int]], pixel_values: Tensor, action_ids: Tensor,
                   temperature: float, top_p: float, pad_id: int, device: torch.device,
                   generator: torch.Generator | Sequence[torch.Generator]) -> Tensor:
    """One action index per prompt, sampled from softmax(logits[action ids] / temperature) at the prompt's end.

    `generator` is one CPU generator for all rows, or one per row (rows that share a generator in a run are
    drawn together), so that a group's draws do not depend on which other groups share the forward."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(prompts):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1
    logits = forward_logits(model, input_ids.to(device), attention_mask.to(device), pixel_values.to(device))
    last = attention_mask.sum(-1).to(device) - 1
    logits = logits[torch.arange(len(prompts), device=device), last][:, action_ids.to(device)]
    probs = top_p_filter(torch.softmax(logits.float() / temperature, dim=-1), top_p).cpu()  # the generators are CPU ones
    if isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    draws, start = [], 0
    while start < len(probs):
        end = start + 1
        while end < len(probs) and generator[end] is generator[start]:
            end += 1
        draws.append(torch.multinomial(probs[start:end], 1, generator=generator[start]).squeeze(-1))
        start = end
    return torch.cat(draws)


def episode_seed(plan: RunPlan, step: int, group: int) -> int:
    """Every episode of group `group` at `step` starts from this seed, and the group's actions are drawn from a
    generator seeded with it (whichever process runs the group)."""
    spec = plan.spec
    return spec.algorithm.seed + step * spec.rollout.prompts_per_step + group


class EpisodeRunner:
    """Runs episodes of some of the step's groups with a policy model; lives where the model lives.

    `group_ids` are this runner's groups (all of them in one process, or every `num_engines`-th on an
    engine actor, `rlspec.rollout.remote.EngineWorker.run_episodes`). The env groups persist between steps.
    """

    def __init__(self, plan: RunPlan, model: torch.nn.Module, processor, device, group_ids: list[int]) -> None:
        spec = plan.spec
        self.plan = plan
        self.model = model
        self.device = torch.device(device)
        self.group_ids = list(group_ids)
        self.groups = {g: build_env_group(spec.rollout.env, spec.algorithm.group_size) for g in self.group_ids}
        first = self.groups[self.group_ids[0]] if self.group_ids else build_env_group(spec.rollout.env, 1)
        self.num_actions, self.max_steps = first.num_actions, first.max_steps
        if not self.group_ids:
            first.close()
        self.action_ids = torch.tensor(action_token_ids(processor.tokenizer, self.num_actions))
        self.encode = PromptEncoder(processor, spec.rollout.env.prompt_template)
        self.pad_id = pad_token_id(processor)

    def close(self) -> None:
        for group in self.groups.values():
            group.close()

    def run(self, step: int) -> tuple[dict[int, list[Episode]], dict[int, str], dict[str, float]]:
        """This runner's episodes of `step` by group, the groups that failed (with why), and `env`/`gen` seconds."""
        spec = self.plan.spec
        timer = PhaseTimer()
        episodes = {g: [Episode() for _ in range(spec.algorithm.group_size)] for g in self.group_ids}
        errors: dict[int, str] = {}
        observations: dict[tuple[int, int], Observation] = {}
        with timer("env"):
            for g, group in self.groups.items():
                try:
                    for i, obs in enumerate(group.reset(episode_seed(self.plan, step, g))):
                        observations[(g, i)] = obs
                except Exception as err:  # noqa: BLE001 - counted and logged, the group is dropped
                    errors[g] = f"reset: {err!r}"
        # One action sampler per group, seeded like its episodes: a group's draws are the same whichever process
        # runs it and whichever groups share its forwards (any number of engines gives the same episodes).
        samplers = {g: torch.Generator().manual_seed(episode_seed(self.plan, step, g)) for g in self.group_ids}
        was_training = self.model.training
        self.model.eval()
        try:
            while observations:
                keys = list(observations)
                with timer("gen"):
                    prompts, pixels = self.encode([observations[k].image for k in keys],
                                                  [observations[k].instruction for k in keys])
                    actions = sample_actions(self.model, prompts, pixels, self.action_ids, spec.rollout.temperature,
                                             spec.rollout.top_p, self.pad_id, self.device, [samplers[g] for g, _ in keys])
                chosen = {k: (prompts[j], pixels[j], int(actions[j])) for j, k in enumerate(keys)}
                observations = self._step(episodes, chosen, errors, timer)
        finally:
            self.model.train(was_training)
        return episodes, errors, dict(timer)

    def _step(self, episodes, chosen, errors, timer) -> dict[tuple[int, int], Observation]:
        """Apply the chosen actions group by group; return the observations of the episodes still running."""
        running = {}
        with timer("env"):
            for g, group in self.groups.items():
                mine = {i: c for (gg, i), c in chosen.items() if gg == g}
                if not mine or g in errors:
                    continue
                try:
                    transitions = group.step([mine[i][2] if i in mine else 0 for i in range(group.num_envs)])
                except Exception as err:  # noqa: BLE001 - counted and logged, the group is dropped
                    errors[g] = f"step: {err!r}"
                    continue
                for i, (prompt, pixels, action) in mine.items():
                    ep, t = episodes[g][i], transitions[i]
                    ep.prompts.append(prompt)
                    ep.pixel_values.append(pixels)
                    ep.actions.append(action)
                    if t.done:
                        ep.done, ep.reward, ep.success, ep.truncated = True, t.reward, t.success, t.truncated
                    else:
                        running[(g, i)] = t.observation
        return running


class EnvRollouts:
    """A step's episodes -> its `TrainBatch` and `env/*` metrics, on the driver.

    With an in-process engine (`model`, `tokenizer` = the model's processor, `device`: the `hf` engine) one
    `EpisodeRunner` runs every group here; with engine actors (`run_episodes`, the Ray backends) each engine
    runs its share of the groups next to its copy of the policy and only the episodes travel.
    """

    def __init__(self, plan: RunPlan, engine) -> None:
        spec = plan.spec
        self.plan = plan
        self.engine = engine
        self.runner = None
        if not hasattr(engine, "run_episodes"):
            self.runner = EpisodeRunner(plan, engine.model, engine.tokenizer, engine.device,
                                        list(range(spec.rollout.prompts_per_step)))
        processor = engine.tokenizer
        self.num_actions, self.max_steps = ((self.runner.num_actions, self.runner.max_steps) if self.runner
                                            else engine.env_info())
        self.action_ids = torch.tensor(action_token_ids(processor.tokenizer, self.num_actions))
        self.pad_id = pad_token_id(processor)

    @property
    def groups(self) -> list:
        """The in-process env groups, in group order (empty with engine actors)."""
        return [self.runner.groups[g] for g in sorted(self.runner.groups)] if self.runner else []

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

    def rollout_batch(self, step: int, timer) -> tuple[TrainBatch, dict]:
        """Run the step's episodes; return the training rows and the `env/*` (and episode reward) metrics."""
        if self.runner is not None:
            episodes, errors, seconds = self.runner.run(step)
        else:
            episodes, errors, seconds = self.engine.run_episodes(step)
        for name, value in seconds.items():
            timer[name] = timer.get(name, 0.0) + value
        for g, message in sorted(errors.items()):
            log.warning("env group %d (seed %d) failed at step %d and is dropped: %s", g, episode_seed(self.plan, step, g),
                        step, message)
        return self._collate([episodes[g] for g in sorted(episodes)], errors)

    def _collate(self, episodes: list[list[Episode]], errors: dict[int, str]) -> tuple[TrainBatch, dict]:
        spec = self.plan.spec
        kept = [g for g in range(len(episodes)) if g not in errors]
        if not kept:
            raise RunError(f"every env group failed this step; first error: {next(iter(errors.values()))}")
        rewards = torch.tensor([[ep.reward for ep in episodes[g]] for g in kept], dtype=torch.float32).view(-1)
        advantages = group_advantages(rewards, spec.algorithm.group_size, spec.algorithm.adv_norm, spec.algorithm.adv_eps)
        flat = [ep for g in kept for ep in episodes[g]]
        weights = episode_weights([len(ep.actions) for ep in flat], spec.algorithm.loss_agg, self.max_steps)
        rows = [(prompt, pixels, int(self.action_ids[a]), float(adv * w), float(ep.reward))
                for ep, adv, w in zip(flat, advantages.tolist(), weights)
                for prompt, pixels, a in zip(ep.prompts, ep.pixel_values, ep.actions)]
        batch = collate_rows(rows, self.action_ids, self.pad_id,
                             multiple=spec.algorithm.updates_per_batch * spec.hardware.num_trainer_ranks)
        lengths = torch.tensor([len(ep.actions) for ep in flat], dtype=torch.float32)
        metrics = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "env/success_rate": sum(ep.success for ep in flat) / len(flat),
            "env/episode_len": float(lengths.mean()),
            "env/episodes": len(flat),
            "env/truncated": sum(ep.truncated for ep in flat),
            "env/errors": len(errors) * spec.algorithm.group_size,
            "env/rows": len(rows),
        }
        return batch, metrics


def episode_weights(lengths: list[int], loss_agg: str, max_steps: int) -> list[float]:
    """Per-episode factor on its rows' advantages so that `algorithm.loss_agg` treats an *episode* as the sequence.

    Every row holds one action token, so over rows each aggregation is a plain mean over the R rows of the
    step. Scaling an episode's advantage by w scales its per-token PPO loss by w exactly (the clip is
    invariant to a positive factor), so with E episodes of lengths T_e::

        token-mean                w = 1                    every action weighs the same
        seq-mean-token-mean       w = R / (E * T_e)        L = (1/E) sum_e (1/T_e) sum_t l_t
        seq-mean-token-sum-norm   w = R / (E * max_steps)  L = (1/E) sum_e sum_t l_t / max_steps

    (the KL term, when on, stays per action).
    """
    rows, episodes = sum(lengths), len(lengths)
    if loss_agg == "seq-mean-token-mean":
        return [rows / (episodes * max(n, 1)) for n in lengths]
    if loss_agg == "seq-mean-token-sum-norm":
        return [rows / (episodes * max_steps)] * episodes
    return [1.0] * episodes


def collate_rows(rows: list[tuple[list[int], Tensor, int, float, float]], action_ids: Tensor, pad_id: int,
                 multiple: int = 1) -> TrainBatch:
    """Rows (prompt ids, pixel values, action token id, advantage, reward) -> a right-padded `TrainBatch`,
    padded with empty rows (loss mask 0, advantage 0) to a multiple of `multiple` rows."""
    num_rows = -(-len(rows) // multiple) * multiple
    length = max(len(r[0]) for r in rows) + 1
    input_ids = torch.full((num_rows, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((num_rows, length), dtype=torch.long)
    loss_mask = torch.zeros((num_rows, length), dtype=torch.float32)
    advantages = torch.zeros(num_rows)
    rewards = torch.zeros(num_rows)
    for i, (prompt, _, action, adv, reward) in enumerate(rows):
        n = len(prompt)
        input_ids[i, :n + 1] = torch.tensor(prompt + [action])
        attention_mask[i, :n + 1] = 1
        loss_mask[i, n] = 1.0
        advantages[i], rewards[i] = adv, reward
    for i in range(len(rows), num_rows):  # empty rows: a real prompt (the model needs its image tokens), no loss
        prompt = rows[0][0]
        input_ids[i, :len(prompt)] = torch.tensor(prompt)
        attention_mask[i, :len(prompt)] = 1
    pixels = [r[1] for r in rows] + [rows[0][1]] * (num_rows - len(rows))
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask, advantages=advantages,
                      rewards=rewards, pixel_values=torch.stack(pixels), action_vocab=action_ids.expand(num_rows, -1).clone())
