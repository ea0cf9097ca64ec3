"""Any reward function that fails: counted in `reward/errors`, its sample dropped (never scored 0), the run
failed past `rollout.task.max_reward_error_rate` — whatever the reward function is."""

from __future__ import annotations

import math

import pytest
import torch

from rlspec.errors import RunError
from rlspec.core.step import rollout_batch
from rlspec.runtime.metrics import PhaseTimer
from rlspec.rollout.base import Rollout
from rlspec.run import build_plan
from rlspec.tasks import score
from rlspec.tasks.base import Prompt, RewardTask
from rlspec.tasks.rewards import Rewards, reward_function
from tests.conftest import REPO


class FixedEngine:
    """Returns completions 'c<i>' with made-up token ids and log-probs (the engine is not under test)."""

    def generate(self, prompts: list[str], n: int, seed: int) -> Rollout:
        count = len(prompts) * n
        return Rollout(prompt_ids=[[5, 6] for _ in range(count)], completion_ids=[[7, 8, 9] for _ in range(count)],
                       completion_logprobs=[[-0.5, -0.25, -1.0] for _ in range(count)],
                       texts=[f"c{i}" for i in range(count)])


def flaky_reward(completion: str, fail: tuple[int, ...] = (), nan: tuple[int, ...] = ()) -> float:
    index = int(completion[1:])
    if index in fail:
        raise ConnectionError(f"scorer unreachable for sample {index}")
    return math.nan if index in nan else index / 100


def flaky_task(**kwargs) -> RewardTask:
    return RewardTask("flaky", [Prompt("p")], Rewards([reward_function(flaky_reward, kwargs)]), seed=0)


@pytest.fixture(scope="module")
def plan():
    import os

    cwd = os.getcwd()
    os.chdir(REPO)
    try:  # 2 prompts x group 4 = 8 samples per step
        return build_plan("examples/tiny.yaml", ["rollout.prompts_per_step=2", "algorithm.group_size=4",
                                                 "algorithm.micro_batch_size=4",
                                                 "rollout.task.max_reward_error_rate=0.4"])[0]
    finally:
        os.chdir(cwd)


def test_score_counts_raises_and_non_finite_as_errors():
    task = flaky_task(fail=(1,), nan=(2,))
    scores = score(task, ["c0", "c1", "c2", "c3"], [Prompt("p")] * 4)
    assert [i for i, _ in scores.errors] == [1, 2]
    assert isinstance(scores.errors[0][1], ConnectionError) and "not a finite number" in str(scores.errors[1][1])
    assert scores.valid.tolist() == [True, False, False, True]
    assert scores.rewards[3].item() == pytest.approx(0.03) and math.isnan(scores.rewards[1].item())


def test_failed_samples_are_dropped_and_groups_renormalised(plan):
    # group 0 = samples 0-3 loses sample 1; group 1 = samples 4-7 loses 5 and 6, keeping 4 and 7
    batch, counters = rollout_batch(plan, FixedEngine(), flaky_task(fail=(1, 5), nan=(6,)), 0, 0, PhaseTimer())
    assert counters["reward/errors"] == 3 and counters["reward/dropped"] == 3
    kept = batch.loss_mask.sum(-1) > 0
    assert kept.tolist() == [True, False, True, True, True, False, False, True]
    assert torch.isnan(batch.rewards[~kept]).all()  # no reward, not 0
    assert (batch.advantages[~kept] == 0).all()
    group0 = torch.tensor([0.00, 0.02, 0.03])
    want = (group0 - group0.mean()) / (group0.std() + plan.spec.algorithm.adv_eps)
    torch.testing.assert_close(batch.advantages[[0, 2, 3]], want)
    assert batch.advantages[4].item() == pytest.approx(-batch.advantages[7].item())  # two members: +-1/sqrt(2)
    assert batch.engine_logprobs[0, 2:5].tolist() == [-0.5, -0.25, -1.0]


def test_a_group_with_one_member_left_is_dropped_whole(plan):
    batch, counters = rollout_batch(plan, FixedEngine(), flaky_task(fail=(0, 1)), 0, 0, PhaseTimer())
    assert counters["reward/errors"] == 2 and counters["reward/dropped"] == 2
    batch, counters = rollout_batch(plan, FixedEngine(), flaky_task(fail=(0,), nan=(1, 2)), 0, 0, PhaseTimer())
    assert counters["reward/errors"] == 3 and counters["reward/dropped"] == 4  # sample 3 has no baseline left
    assert batch.loss_mask[:4].sum() == 0 and batch.loss_mask[4:].sum() > 0


def test_past_the_error_rate_the_run_fails_naming_the_key(plan):
    with pytest.raises(RunError) as caught:
        rollout_batch(plan, FixedEngine(), flaky_task(fail=(0, 3, 6), nan=(7,)), 7, 0, PhaseTimer())  # 4/8 > 0.4
    text = str(caught.value)
    assert "rollout.task.max_reward_error_rate=0.4" in text and "4 of 8" in text and "50.0%" in text
    assert "step 7" in text and "ConnectionError" in text and "flaky_reward" in text  # the failure's traceback


def test_a_step_whose_every_reward_failed_leaves_the_weights_alone(monkeypatch):
    """Every sample dropped (max_reward_error_rate=1 lets the run go on): the standalone trainer takes no optimizer
    step, so AdamW's weight decay cannot move the weights either, and the row says why."""
    from rlspec.core.step import metrics_row, update
    from rlspec.core.trainer import LocalTrainer

    monkeypatch.chdir(REPO)
    plan = build_plan("examples/tiny.yaml", ["rollout.prompts_per_step=2", "algorithm.group_size=4",
                                             "algorithm.micro_batch_size=4", "algorithm.weight_decay=0.1",
                                             "rollout.task.max_reward_error_rate=1.0"])[0]
    spec = plan.spec
    trainer = LocalTrainer(spec.model, spec.algorithm, spec.rollout.temperature, spec.rollout.max_new_tokens)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    batch, counters = rollout_batch(plan, FixedEngine(), flaky_task(fail=tuple(range(8))), 0, 0, PhaseTimer())
    result = update(plan, trainer, batch)
    assert all(torch.equal(p, before[name]) for name, p in trainer.model.named_parameters())
    assert not trainer.optimizer.state  # never stepped
    row = metrics_row(plan, 0, result, PhaseTimer(step=1.0), 0, counters)
    assert row["reward/dropped"] == 8 and row["update/skipped"] == 1
    assert row["update/skip_reason"] == "every sample was dropped"
