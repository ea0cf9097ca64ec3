"""Tasks: rewards by hand, GSM8K extraction, file formats, and kwargs checking."""

from __future__ import annotations

import json

import pytest

from rlspec.spec import SpecError, TaskSpec
from rlspec.tasks import build_task, gsm8k
from rlspec.tasks.base import Prompt
from tests.conftest import REPO

SAMPLE = str(REPO / "examples" / "data" / "gsm8k_sample.jsonl")


def test_copy_char_reward_and_prompts():
    task = build_task(TaskSpec(name="copy_char", dataset_kwargs={"alphabet": "xy"}, reward_kwargs={"target_len": 4}), seed=1)
    prompts = task.sample(step=3, n=50)
    assert {p.text for p in prompts} == {"x=", "y="}
    assert task.sample(3, 50) == prompts and task.sample(4, 50) != prompts  # deterministic per step
    p = Prompt("x=", {"letter": "x"})
    assert task.reward("xxxx", p) == 1.0
    assert task.reward("xyxy", p) == 0.5
    assert task.reward("x", p) == 0.25  # an early end scores the missing characters as wrong
    repeated = build_task(TaskSpec(name="copy_char", dataset_kwargs={"alphabet": "xy", "repeat": 3}), seed=1)
    assert {p.text for p in repeated.sample(3, 50)} == {"xxx=", "yyy="}
    assert [p.meta for p in repeated.sample(3, 50)] == [p.meta for p in prompts]
    with pytest.raises(SpecError, match=r"rollout\.task\.dataset_kwargs.*repeat must be at least 1"):
        build_task(TaskSpec(name="copy_char", dataset_kwargs={"repeat": 0}), seed=1)


@pytest.mark.parametrize("completion, method, want", [
    ("so 3 + 4 = 7\n#### 7", "strict", 1.0),
    ("the answer is 7", "strict", 0.0),        # strict needs the #### marker
    ("the answer is 7", "flexible", 1.0),
    ("#### 1,234", "strict", 0.0),             # extracted but wrong: format_score
    ("#### 7.0", "strict", 1.0),               # numeric comparison
    ("first 7 then 8", "flexible", 0.0),       # flexible takes the last number
])
def test_gsm8k_reward(completion, method, want):
    assert gsm8k.reward(completion, "work\n#### 7", method=method) == want


def test_gsm8k_format_score_and_thousands():
    assert gsm8k.reward("#### 1,234", "#### 1,234") == 1.0
    assert gsm8k.reward("#### 99", "1234", format_score=0.1) == 0.1


def test_gsm8k_sample_file_and_reward_kwargs_reach_the_function():
    task = build_task(TaskSpec(name="gsm8k", data_path=SAMPLE, reward_kwargs={"method": "flexible", "score": 2.0}), seed=0)
    prompt = task.sample(0, 1)[0]
    reference = gsm8k.reference_answer(prompt.meta["answer"])
    assert prompt.text.startswith("Question: ") and reference.lstrip("-").isdigit()
    assert task.reward(f"it is {reference}", prompt) == 2.0


def test_gsm8k_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    records = [json.loads(line) for line in open(SAMPLE)][:5]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    task = build_task(TaskSpec(name="gsm8k", data_path=str(path), shuffle=False), 0)
    assert [p.meta["answer"] for p in task.sample(0, 5)] == [r["answer"] for r in records]


def test_bad_task_inputs_name_the_key(tmp_path):
    with pytest.raises(SpecError, match=r"rollout\.task\.reward_kwargs\.methd"):
        build_task(TaskSpec(name="gsm8k", data_path=SAMPLE, reward_kwargs={"methd": "strict"}), 0)
    with pytest.raises(SpecError, match=r"rollout\.task\.reward_kwargs.*strict or flexible"):
        build_task(TaskSpec(name="gsm8k", data_path=SAMPLE, reward_kwargs={"method": "fuzzy"}), 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{not json}\n')
    with pytest.raises(SpecError, match=r"bad\.jsonl:2"):
        build_task(TaskSpec(name="gsm8k", data_path=str(bad)), 0)
