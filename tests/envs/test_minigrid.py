"""MiniGrid env groups and env rollouts: determinism per seed, counted truncations and errors, collation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlspec.envs import build_env_group
from rlspec.runtime.metrics import PhaseTimer
from rlspec.spec import EnvSpec
from tests.conftest import REPO

LEVEL = "BabyAI-GoToRedBallNoDists-v0"


def _group(num_envs: int = 3, **fields):
    return build_env_group(EnvSpec(name="minigrid", level=LEVEL, **fields), num_envs)


def test_reset_is_deterministic_per_seed_and_copies_start_identical():
    a, b = _group(), _group()
    try:
        first, again = a.reset(7), b.reset(7)
        other = a.reset(8)
        assert a.num_actions == 7 and len(first) == 3
        assert first[0].image.shape == (56, 56, 3) and first[0].image.dtype == np.uint8
        assert first[0].instruction == "go to the red ball"
        for x, y in zip(first, again):
            assert np.array_equal(x.image, y.image) and x.instruction == y.instruction
        assert all(np.array_equal(first[0].image, o.image) for o in first)  # one group: one start
        assert not all(np.array_equal(x.image, y.image) for x, y in zip(first, other))
        a.reset(7)
        steps_a = [a.step([2, 0, 1]) for _ in range(3)]
        steps_b = [b.step([2, 0, 1]) for _ in range(3)]
        for ta, tb in zip(steps_a, steps_b):
            assert all(np.array_equal(x.observation.image, y.observation.image) and x.reward == y.reward
                       for x, y in zip(ta, tb))
    finally:
        a.close()
        b.close()


def test_step_limit_truncates():
    group = _group(num_envs=2, max_steps=2)
    try:
        group.reset(0)
        group.step([0, 1])
        last = group.step([0, 1])  # turning in place never succeeds
        assert all(t.truncated and not t.terminated and t.reward == 0.0 and not t.success for t in last)
    finally:
        group.close()


@pytest.fixture(scope="module")
def runner_parts():
    from rlspec.models.factory import load_model, load_tokenizer
    from rlspec.run import build_plan

    plan, _ = build_plan(str(REPO / "examples" / "vla_babyai.yaml"), [
        f"rollout.env.level={LEVEL}", "rollout.prompts_per_step=2", "algorithm.group_size=2", "rollout.env.max_steps=3",
        "algorithm.micro_batch_size=2", "algorithm.updates_per_batch=2"])
    engine = SimpleNamespace(model=load_model(plan.spec.model, 0), tokenizer=load_tokenizer(plan.spec.model),
                             device=torch.device("cpu"))
    return plan, engine


def test_env_rollout_collates_per_step_rows(runner_parts):
    from rlspec.envs.rollout import EnvRollouts

    plan, engine = runner_parts
    runner = EnvRollouts(plan, engine)
    try:
        timer = PhaseTimer()
        batch, metrics = runner.rollout_batch(0, timer)
    finally:
        runner.close()
    assert metrics["env/episodes"] == 4 and metrics["env/errors"] == 0
    assert 4 <= metrics["env/rows"] <= 12 and metrics["env/episode_len"] <= 3
    assert len(batch) % 2 == 0 and len(batch) - metrics["env/rows"] in (0, 1)  # padded to updates_per_batch
    assert timer["env"] > 0 and timer["gen"] > 0
    rows = int(metrics["env/rows"])
    assert batch.loss_mask[:rows].sum(-1).tolist() == [1.0] * rows
    assert batch.loss_mask[rows:].sum() == 0 and batch.advantages[rows:].abs().sum() == 0
    assert batch.pixel_values.shape == (len(batch), 3, 56, 56)
    last = batch.attention_mask[:rows].sum(-1) - 1
    actions = batch.input_ids[torch.arange(rows), last]
    assert set(actions.tolist()) <= set(batch.action_vocab[0].tolist())
    truncated_or_success = metrics["env/truncated"] + round(metrics["env/success_rate"] * 4)
    assert truncated_or_success == 4  # with no distractor, an episode ends only by success or the step limit


def test_env_errors_are_counted_and_the_group_dropped(runner_parts, monkeypatch, caplog):
    from rlspec.envs.minigrid import MiniGridGroup
    from rlspec.envs.rollout import EnvRollouts

    plan, engine = runner_parts
    runner = EnvRollouts(plan, engine)
    original = MiniGridGroup.step

    def flaky(self, actions):
        if self is runner.groups[1]:
            raise RuntimeError("simulator crashed")
        return original(self, actions)

    monkeypatch.setattr(MiniGridGroup, "step", flaky)
    try:
        batch, metrics = runner.rollout_batch(0, PhaseTimer())
    finally:
        runner.close()
    assert metrics["env/errors"] == 2 and metrics["env/episodes"] == 2
    assert "simulator crashed" in caplog.text
    assert metrics["env/rows"] == int(batch.loss_mask.sum())


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_episode_weights_make_the_episode_the_sequence(loss_agg):
    """Per-step rows with weighted advantages give the aggregation's formula with episodes as sequences."""
    from rlspec.envs.rollout import episode_weights
    from rlspec.core.grpo import LossConfig, LossNorm, policy_loss

    lengths, advantages, max_steps = [3, 1, 2], [0.5, -1.0, 0.25], 4
    weights = episode_weights(lengths, loss_agg, max_steps)
    rows = torch.tensor([a * w for a, w, n in zip(advantages, weights, lengths) for _ in range(n)])
    mask = torch.ones(len(rows), 1)
    zeros = torch.zeros(len(rows), 1)
    loss, _ = policy_loss(zeros, zeros, rows, mask, LossNorm.of(mask, 1), LossConfig(loss_agg=loss_agg))
    per_token = [[-a] * n for a, n in zip(advantages, lengths)]  # ratio 1: l_t = -A
    want = {
        "token-mean": sum(map(sum, per_token)) / sum(lengths),
        "seq-mean-token-mean": sum(sum(t) / len(t) for t in per_token) / len(lengths),
        "seq-mean-token-sum-norm": sum(sum(t) / max_steps for t in per_token) / len(lengths),
    }[loss_agg]
    assert loss.item() == pytest.approx(want, rel=1e-6)
