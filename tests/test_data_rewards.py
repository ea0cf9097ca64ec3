"""Your own data and reward: the column mapping and its plan-time checks, reward functions by path, their forms,
weights and failures, and the shipped examples through the real entry point."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from rlspec.cli import main
from rlspec.runtime.metrics import read_metrics
from rlspec.spec import RewardSpec, SpecError, TaskSpec
from rlspec.tasks import build_task, check_task
from rlspec.tasks.base import Prompt, RecordOrder
from rlspec.tasks.rewards import Rewards, reward_function
from tests.conftest import REPO, rlspec_cmd

RECORDS = [{"question": f"q{i}", "solution": str(i), "level": i % 3} for i in range(6)]
SMALL = ["algorithm.steps=2", "rollout.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=4",
         "rollout.max_new_tokens=4"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The same records as .jsonl, .parquet, a saved Dataset and a saved DatasetDict (train and test)."""
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("data")
    (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    table = datasets.Dataset.from_list(RECORDS)
    table.to_parquet(str(root / "d.parquet"))
    table.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select(range(2))}).save_to_disk(str(root / "splits"))
    (root / "rewards.py").write_text(
        "import asyncio\n"
        "def exact(completion, answer):\n    return float(completion.strip() == answer)\n"
        "def by_level(completions, level, bonus=0.0):\n    return [l + bonus for l in level]\n"
        "async def slow(completion, prompt):\n    await asyncio.sleep(0.01)\n    return len(prompt)\n"
        "async def slow_batch(completions):\n    return [1.0] * len(completions)\n"
        "gate = asyncio.Semaphore(1)\n"
        "async def gated(completion):\n    async with gate:\n        await asyncio.sleep(0)\n    return 1.0\n"
        "def picky(completion, answer):\n    if answer == '3':\n        raise KeyError('no grader for 3')\n    return 1.0\n"
        "def needs_grade(completion, grade):\n    return 0.0\n"
        "def ambiguous(text):\n    return 0.0\n")
    return root


def task_spec(root, path="d.jsonl", **kw) -> TaskSpec:
    kw = {"prompt_column": "question", "answer_column": "solution", "reward": f"{root / 'rewards.py'}:exact", **kw}
    return TaskSpec(name="dataset", data_path=str(root / path), **kw)


@pytest.mark.parametrize("path, split", [("d.jsonl", "train"), ("d.parquet", "train"), ("saved", "train"),
                                         ("splits", "train"), ("splits", "test")])
def test_every_format_reads_the_same_records(data_dir, path, split):
    task = build_task(task_spec(data_dir, path, split=split, shuffle=False), seed=0)
    want = RECORDS if split == "train" else RECORDS[:2]
    prompts = task.sample(0, len(want))
    assert [p.text for p in prompts] == [r["question"] for r in want]
    assert [p.meta for p in prompts] == [{**r, "answer": r["solution"]} for r in want]
    assert task.reward(" 0", prompts[0]) == 1.0 and task.reward("1", prompts[0]) == 0.0


def test_records_are_drawn_pass_after_pass_in_a_seeded_order(data_dir):
    order = RecordOrder(5, seed=3)
    first, second = order.indices(0, 5), order.indices(1, 5)
    assert sorted(first) == sorted(second) == list(range(5)) and first != second  # every record once per pass
    assert RecordOrder(5, seed=3).indices(1, 5) == second  # a step's draws depend on its number only
    assert RecordOrder(5, seed=None).indices(1, 3) == [3, 4, 0]
    task = build_task(task_spec(data_dir, num_records=4, shuffle=False), seed=0)
    assert [p.text for p in task.sample(0, 6)] == ["q0", "q1", "q2", "q3", "q0", "q1"]


def mapping_error(spec: TaskSpec) -> str:
    with pytest.raises(SpecError) as caught:
        check_task(spec)
    return str(caught.value)


@pytest.mark.parametrize("path", ["d.jsonl", "d.parquet", "saved", "splits"])
def test_a_missing_column_is_named_with_the_columns_there_are(data_dir, path):
    text = mapping_error(task_spec(data_dir, path, prompt_column="prompt"))
    assert text.startswith("rollout.task.prompt_column:") and "no column 'prompt'" in text
    assert "the columns are: question, solution, level" in text
    assert "'answer'" in mapping_error(task_spec(data_dir, path, answer_column="answer"))
    text = mapping_error(task_spec(data_dir, path, prompt_template="Q: {topic}"))
    assert text.startswith("rollout.task.prompt_template:") and "'topic'" in text


def test_a_struct_field_is_the_answer_as_in_verl_data(data_dir, tmp_path):
    """verl's data: chat messages in `prompt`, the reference in `reward_model.ground_truth`."""
    import datasets

    record = {"data_source": "math", "prompt": [{"role": "user", "content": "1+1?"}],
              "reward_model": {"style": "rule", "ground_truth": "2"}}
    datasets.Dataset.from_list([record]).to_parquet(str(tmp_path / "verl.parquet"))
    spec = task_spec(tmp_path, "verl.parquet", prompt_column="prompt", answer_column="reward_model.ground_truth",
                     reward=f"{data_dir / 'rewards.py'}:exact")
    prompt = build_task(spec, 0).sample(0, 1)[0]
    assert prompt.meta["answer"] == "2" and prompt.text.endswith("<|im_start|>assistant\n")
    text = mapping_error(task_spec(tmp_path, "verl.parquet", prompt_column="prompt", answer_column="reward_model.truth"))
    assert "no field 'truth' in reward_model — the fields of reward_model are: style, ground_truth" in text


def test_data_problems_name_the_key(data_dir, tmp_path):
    assert "has no split 'dev'" in mapping_error(task_spec(data_dir, "splits", split="dev"))
    assert "use one of: train, test" in mapping_error(task_spec(data_dir, "splits", split="dev"))
    assert "one split" in mapping_error(task_spec(data_dir, "d.parquet", split="test"))
    assert "not one saved by datasets" in mapping_error(task_spec(tmp_path, "."))
    (tmp_path / "d.csv").write_text("a,b\n")
    assert "by its suffix" in mapping_error(task_spec(tmp_path, "d.csv"))
    with pytest.raises(SpecError, match="rollout.task.reward: the dataset task has no reward of its own"):
        TaskSpec(name="dataset", data_path="x.jsonl")
    with pytest.raises(SpecError, match="rollout.task.rewards: .*both set"):
        TaskSpec(name="dataset", data_path="x.jsonl", reward="a.py:f", rewards=[RewardSpec("b.py:g")])


@pytest.mark.parametrize("reward, needle", [
    ("nowhere.py:exact", "rollout.task.reward: nowhere.py does not exist"),
    ("rewards.py:exakt", "has no function 'exakt' — name a function defined there: ambiguous, by_level, exact"),
    ("no_such_package.rewards:exact", "cannot import no_such_package.rewards"),
    ("rewards.py:needs_grade", "needs the argument 'grade', which is neither a column of the data (answer, level"),
    ("rewards.py:ambiguous", "takes neither `completion` (one sample) nor `completions`"),
    ("exact", "is not of the form module:function"),
])
def test_a_reward_that_cannot_be_reached_is_named(data_dir, reward, needle, monkeypatch):
    monkeypatch.chdir(data_dir)
    with pytest.raises(SpecError) as caught:
        check_task(task_spec(data_dir, reward=reward))
    assert needle in str(caught.value)


def test_reward_kwargs_are_checked_against_the_signature(data_dir):
    rewards = [RewardSpec(f"{data_dir / 'rewards.py'}:by_level", kwargs={"bonus": 1, "bonnus": 2})]
    assert mapping_error(task_spec(data_dir, reward="task", rewards=rewards)).startswith(
        "rollout.task.rewards[0].kwargs.bonnus: ")
    text = mapping_error(TaskSpec(name="gsm8k", data_path=str(REPO / "examples/data/gsm8k_sample.jsonl"),
                                  reward_kwargs={"method": "fuzzy"}))
    assert text.startswith("rollout.task.reward_kwargs.method") and "strict or flexible" in text


def prompts(n=4) -> list[Prompt]:
    return [Prompt(f"p{i}", {"answer": str(i), "level": i}) for i in range(n)]


def test_the_forms_and_weights_of_reward_functions(data_dir, monkeypatch):
    monkeypatch.chdir(data_dir)
    spec = task_spec(data_dir, reward="task", rewards=[
        RewardSpec("rewards.py:exact", weight=2.0),
        RewardSpec("rewards.py:by_level", weight=0.5, kwargs={"bonus": 1.0}),  # batched
        RewardSpec("rewards.py:slow"),                                        # async, one sample
        RewardSpec("rewards.py:slow_batch", weight=-1.0, name="constant"),    # async, batched
    ])
    task = build_task(spec, seed=0)
    values, metrics = task.score_batch(["0", "x", "2", "x"], prompts(), [[1], [2], [3], [4]])
    exact, level, slow, constant = [1, 0, 1, 0], [1, 2, 3, 4], 2, 1  # slow: len("p0"); levels 0-3 plus the bonus
    assert values == [2.0 * e + 0.5 * v + slow - constant for e, v in zip(exact, level)]
    assert metrics == {"reward/exact/mean": 0.5, "reward/by_level/mean": 2.5, "reward/slow/mean": 2.0,
                       "reward/constant/mean": 1.0}


def test_async_functions_share_one_event_loop_across_steps(data_dir, monkeypatch):
    """A module-level semaphore binds to the loop it first waits on: a new loop per step would break it."""
    monkeypatch.chdir(data_dir)
    task = build_task(task_spec(data_dir, reward="rewards.py:gated"), seed=0)
    for _ in range(2):
        assert task.score_batch(["a"] * 4, prompts(), None)[0] == [1.0] * 4


def test_a_failing_reward_fails_its_sample_and_prints_the_first_traceback(data_dir, monkeypatch, capsys):
    monkeypatch.chdir(data_dir)
    spec = task_spec(data_dir, reward="task", rewards=[RewardSpec("rewards.py:picky"), RewardSpec("rewards.py:by_level")])
    task = build_task(spec, seed=0)
    values, metrics = task.score_batch(["a"] * 4, prompts(), None)
    assert values[:3] == [1.0, 2.0, 3.0] and isinstance(values[3], KeyError)
    assert metrics["reward/picky/mean"] == 1.0  # over the samples it scored
    task.score_batch(["a"] * 4, prompts(), None)
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "reward function picky failed" in err and "no grader for 3" in err
    odd = Rewards([reward_function(lambda completions: [1.0, None, math.inf, "x"])])
    results, _ = odd.score_batch(["a"] * 4, prompts(), None)
    assert results[0] == 1.0 and all(isinstance(r, ValueError) for r in results[1:])
    short = Rewards([reward_function(lambda completions: [1.0])])
    assert all("returned 1 values for 4" in str(r) for r in short.score_batch(["a"] * 4, prompts(), None)[0])


def test_chat_messages_are_rendered_with_the_chat_template():
    from rlspec.models.factory import load_tokenizer
    from rlspec.spec import ModelSpec

    spec = TaskSpec(name="dataset", data_path=str(REPO / "examples/data/letters_chat.jsonl"), prompt_column="messages",
                    reward="examples/rewards/letters.py:copies", shuffle=False)
    record = json.loads((REPO / "examples/data/letters_chat.jsonl").read_text().splitlines()[0])
    prompt = build_task(spec, 0, ModelSpec()).sample(0, 1)[0]
    want = load_tokenizer(ModelSpec()).apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=False)
    assert prompt.text == want and prompt.text.endswith("<|im_start|>assistant\n") and "Letter: a" in prompt.text
    assert prompt.meta["answer"] == "a"


def test_a_run_started_before_these_fields_existed_resumes():
    """A plan.json without the data and reward fields counts them as their defaults: nothing refused."""
    from rlspec.spec import resume_changes

    now = json.loads((REPO / "tests" / "golden" / "tiny_plan.json").read_text())["spec"]
    started = json.loads(json.dumps(now))
    for key in ("split", "prompt_column", "prompt_template", "answer_column", "shuffle", "shuffle_seed", "num_records",
                "rewards"):
        del started["rollout"]["task"][key]
    assert resume_changes(started, now) == ([], [])


def test_checking_a_task_imports_neither_torch_nor_datasets():
    code = ("import sys; from rlspec.spec import TaskSpec; from rlspec.tasks import check_task\n"
            "check_task(TaskSpec(name='dataset', data_path='examples/data/letters.parquet', "
            "reward='examples/rewards/letters.py:copies'))\n"
            "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("spec, keys", [
    ("examples/dataset_parquet.yaml", []),
    ("examples/dataset_chat.yaml", ["reward/copies/mean", "reward/brevity/mean"]),
])
def test_examples_train_through_the_real_entry_point(spec, keys, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(rlspec_cmd("run", spec, *SMALL, "--out", str(out), "--no-progress"),
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and all(r["reward/errors"] == 0 for r in rows)
    for row in rows:
        assert all(key in row for key in keys)
        if keys:  # the reward is the weighted sum of the functions' means (no sample failed)
            assert row["reward/mean"] == pytest.approx(row[keys[0]] + 0.2 * row[keys[1]], abs=1e-6)


def test_plan_refuses_a_missing_column_and_a_missing_function(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["plan", "examples/dataset_parquet.yaml", "rollout.task.answer_column=solution"]) == 2
    err = capsys.readouterr().err
    assert "rollout.task.answer_column" in err and "'solution'" in err and "the columns are: prompt, answer, repeat" in err
    assert main(["plan", "examples/dataset_parquet.yaml", "rollout.task.reward=examples/rewards/letters.py:copy"]) == 2
    assert "has no function 'copy'" in capsys.readouterr().err


def test_a_run_whose_reward_fails_for_some_samples_drops_them_and_logs_the_first_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    reward = tmp_path / "fails.py"
    reward.write_text("def half(completion, repeat):\n    if repeat == 2:\n        raise RuntimeError('cannot grade')\n"
                      "    return 1.0\n")
    out = tmp_path / "out"
    code = main(["run", "examples/dataset_parquet.yaml", *SMALL, "algorithm.steps=1", f"rollout.task.reward={reward}:half",
                 "~rollout.task.reward_kwargs.target_len", "rollout.task.max_reward_error_rate=1.0", "rollout.prompts_per_step=6",
                 "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[0]["reward/errors"] == 2 and rows[0]["reward/dropped"] == 2  # of the 6 records drawn, one has repeat 2
    log = (out / "run.log").read_text()
    assert log.count("RuntimeError: cannot grade") == 1 and "reward function half failed" in log
