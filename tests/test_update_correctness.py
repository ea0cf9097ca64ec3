"""The update on batches of varying size, what the seed controls, and Dr. GRPO's constant for agents.

The mini-batch split and the normaliser are the driver's (`rlspec.core.step.update`) and the data order is drawn in
the driver (`rlspec.run.build_plan`), the same code for every backend; the backends' own halves (ranks sharing an
uneven mini-batch, the eval-mode no-gradient passes) are in tests/backends.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from rlspec.core.batch import TrainBatch
from rlspec.core.policy import eval_mode
from rlspec.core.step import mini_batch_bounds, update
from rlspec.run import build_plan
from rlspec.spec import SpecError
from spec.compile import fewest_agent_rows
from tests.conftest import REPO

BACKENDS = ("standalone", "deepspeed", "fsdp")
TINY = str(REPO / "examples" / "tiny.yaml")
AGENT = str(REPO / "examples" / "agent_copy_two_turn.yaml")
PARQUET = str(REPO / "examples" / "dataset_parquet.yaml")


class RecordingBackend:
    """Records each optimizer update's rows and loss normaliser."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.norms: list = []
        self.steps = 0

    def logprobs(self, batch, reference=False):
        return torch.zeros(batch.input_ids.shape)

    def forward_backward(self, batch, norm):
        self.rows.append(len(batch))
        self.norms.append(norm)
        return {"loss": 1.0, "tokens": float(batch.loss_mask.sum()), "clipped_tokens": 0.0, "entropy_sum": 0.0,
                "kl_sum": 0.0, "is_ratio_sum": 0.0, "is_clipped_tokens": 0.0}

    def optimizer_step(self):
        self.steps += 1
        return 1.0


@functools.cache
def tiny_plan(backend: str, updates: int):
    return build_plan(TINY, ["rollout.prompts_per_step=4", "algorithm.group_size=4", "algorithm.micro_batch_size=1",
                             f"algorithm.updates_per_batch={updates}"], backend=backend, full=False)[0]


def rows(n: int) -> TrainBatch:
    mask = torch.zeros(n, 4)
    mask[:, 2:] = 1
    return TrainBatch(input_ids=torch.ones(n, 4, dtype=torch.long), attention_mask=torch.ones(n, 4, dtype=torch.long),
                      loss_mask=mask, advantages=torch.linspace(-1, 1, n), rewards=torch.zeros(n))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_rows, updates, sizes", [
    (16, 2, [8, 8]), (13, 2, [7, 6]), (7, 4, [2, 2, 2, 1]), (3, 4, [1, 1, 1])])
def test_any_row_count_takes_exactly_updates_per_batch_steps(backend, num_rows, updates, sizes):
    """Rows dropped by an agent: still `updates_per_batch` mini-batches, as equal as the rows allow (the first ones
    a row larger); with fewer rows than updates the empty ones are skipped and counted, not a crash."""
    plan = tiny_plan(backend, updates)
    recorder = RecordingBackend()
    result = update(plan, recorder, rows(num_rows))
    assert recorder.rows == sizes and recorder.steps == len(sizes) == len(result.grad_norms)
    assert result.skipped == updates - len(sizes)
    assert [n.num_sequences for n in recorder.norms] == sizes  # each mini-batch normalised over itself


def test_mini_batch_bounds_are_numpys_array_split():
    np = pytest.importorskip("numpy")
    for num_rows, updates in itertools.product(range(0, 20), range(1, 7)):
        want = [(int(part[0]), int(part[-1]) + 1) if len(part) else None
                for part in np.array_split(np.arange(num_rows), updates)]
        got = mini_batch_bounds(num_rows, updates)
        assert len(got) == updates
        assert [b if b[1] > b[0] else None for b in got] == want


def test_fewest_agent_rows_is_the_worst_case_of_the_gateways_rule():
    """Against every set of failed trajectories the failure rate allows: a group keeps its members only if at least
    two are left (`rlspec.agent.gateway`); a step that keeps none fails on its own."""
    for prompts, group_size, rate in [(1, 4, 0.25), (2, 4, 0.25), (2, 3, 0.5), (3, 2, 0.34), (3, 3, 1.0), (2, 4, 0.0),
                                      (3, 4, 0.57)]:
        jobs = prompts * group_size
        kept_counts = []
        for failed in itertools.product((False, True), repeat=jobs):
            if sum(failed) / jobs > rate:
                continue
            alive = [group_size - sum(failed[g * group_size:(g + 1) * group_size]) for g in range(prompts)]
            kept = sum(a for a in alive if a >= 2)
            if kept:
                kept_counts.append(kept)
        assert fewest_agent_rows(prompts, group_size, rate) == min(kept_counts), (prompts, group_size, rate)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_plan_refuses_more_updates_than_an_agent_step_can_keep(backend):
    base = ["rollout.prompts_per_step=1", "algorithm.group_size=4", "algorithm.micro_batch_size=1"]
    with pytest.raises(SpecError, match=r"algorithm\.updates_per_batch.*as few as 3 of its 4") as refused:
        build_plan(AGENT, [*base, "algorithm.updates_per_batch=4"], backend=backend, full=False)
    assert "at most 3" in str(refused.value)
    build_plan(AGENT, [*base, "algorithm.updates_per_batch=4", "rollout.agent.max_failure_rate=0"], backend=backend,
               full=False)
    build_plan(AGENT, [*base, "algorithm.updates_per_batch=2"], backend=backend, full=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dr_grpo_constant_is_the_trained_token_budget_of_a_trajectory(backend):
    agent, _ = build_plan(AGENT, ["rollout.max_new_tokens=4", "rollout.agent.max_turns=3"], backend=backend, full=False)
    plain, _ = build_plan(TINY, ["rollout.max_new_tokens=4"], backend=backend, full=False)
    assert (agent.batch.max_trained_tokens, plain.batch.max_trained_tokens) == (12, 4)
    recorder = RecordingBackend()
    update(agent, recorder, rows(agent.batch.sequences_per_step))
    assert {n.max_new_tokens for n in recorder.norms} == {12}


def first_pass(task, n: int = 8) -> list[str]:
    return [p.text for p in task.sample(0, n)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sweep_over_algorithm_seed_varies_the_record_order(backend, monkeypatch):
    """The task a run builds (`build_plan`, in the driver for every backend) draws its records in an order of
    algorithm.seed's: a seed sweep (docs/sweeps.md) trains each seed on other data."""
    monkeypatch.chdir(REPO)
    orders = [first_pass(build_plan(PARQUET, [f"algorithm.seed={seed}"], backend=backend)[1]) for seed in (0, 1)]
    assert orders[0] != orders[1]


def test_shuffle_seed_fixes_the_order_across_seeds_and_shuffle_false_keeps_the_files(monkeypatch):
    import dataclasses

    from rlspec.tasks import build_task

    monkeypatch.chdir(REPO)
    spec = build_plan(PARQUET, full=False)[0].spec.rollout.task

    def order(seed: int, **changes) -> list[str]:
        return first_pass(build_task(dataclasses.replace(spec, **changes), seed))

    by_seed = [order(seed) for seed in range(3)]
    assert len({tuple(o) for o in by_seed}) == 3
    assert order(1) == by_seed[1]  # each seed's order is reproducible
    fixed = [order(seed, shuffle_seed=7) for seed in range(2)]
    assert fixed[0] == fixed[1] != by_seed[0]
    assert order(5, shuffle_seed=0) == by_seed[0]  # what the old default (shuffle_seed 0) gave every seed
    in_file = order(2, shuffle=False)
    assert in_file == order(1, shuffle=False) not in by_seed


def test_a_shuffle_seed_without_shuffling_is_refused():
    with pytest.raises(SpecError, match=r"rollout\.task\.shuffle_seed.*rollout\.task\.shuffle=false"):
        build_plan(PARQUET, ["rollout.task.shuffle=false", "rollout.task.shuffle_seed=3"], full=False)


def test_a_run_started_before_shuffle_keeps_its_order_on_resume():
    """A plan.json from before `rollout.task.shuffle`: its null shuffle_seed meant the file's order, and its seed 0
    what algorithm.seed 0 now gives; resuming with another order is refused, naming the key."""
    import json

    from rlspec.spec import resume_changes

    now = json.loads((REPO / "tests" / "golden" / "tiny_plan.json").read_text())["spec"]
    for old_seed, refused in ((None, ["rollout.task.shuffle"]), (0, ["rollout.task.shuffle_seed"])):
        started = json.loads(json.dumps(now))
        del started["rollout"]["task"]["shuffle"]
        started["rollout"]["task"]["shuffle_seed"] = old_seed
        assert resume_changes(started, now) == ([], refused)


def test_eval_mode_switches_dropout_off_and_puts_every_modules_mode_back():
    dropout = torch.nn.Dropout(0.5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), dropout, torch.nn.Sequential(torch.nn.Dropout(0.5)))
    model.train()
    model[2].eval()  # a frozen part stays as it was
    x = torch.ones(2, 4)
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
        assert torch.equal(model(x), model(x))
    assert [m.training for m in model.modules()] == [True, True, True, False, False]
    with pytest.raises(RuntimeError), eval_mode(model):
        raise RuntimeError
    assert model.training and model[1].training
