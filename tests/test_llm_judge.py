"""The remote judge against a local server that fails in scripted ways: retries with backoff, the model
fallback chain, bounded requests, dropped samples, the API key kept secret, and the spec checks."""

from __future__ import annotations

import json
import random

import pytest

from rlspec.errors import SpecError
from rlspec.runtime.metrics import read_metrics
from rlspec.spec import JudgeSpec, TaskSpec
from rlspec.tasks import build_task, score
from rlspec.tasks.base import Prompt
from rlspec.tasks.llm_judge import JudgeClient, JudgeError, backoff_delay_s
from tests.conftest import REPO
from tests.judge_server import ScriptedJudge

PROMPT = Prompt("a=", {"letter": "a"})


def client(judge: ScriptedJudge, models=("judge-a", "judge-b"), sleeps: list | None = None, **overrides) -> JudgeClient:
    spec = JudgeSpec(base_url=judge.base_url, models=list(models), api_key_env=None,
                     **{"timeout_s": 0.3, "max_retries": 2, "backoff_s": 0.01, "backoff_max_s": 0.05, **overrides})
    return JudgeClient(spec, api_key="sk-test-123", sleep=(sleeps.append if sleeps is not None else lambda s: None))


@pytest.mark.parametrize("failure", ["500", "503", "timeout", "malformed", "noscore", "429:0"])
def test_transient_failures_are_retried_on_the_same_model(failure):
    with ScriptedJudge({"judge-a": [failure, failure, "ok:0.75"]}, slow_s=0.8) as judge:
        sleeps: list[float] = []
        value, counts = client(judge, sleeps=sleeps).score(PROMPT, "aaaa")
    assert value == 0.75
    assert [m for m, _ in judge.requests] == ["judge-a"] * 3
    assert counts == {"reward/judge_requests": 3, "reward/retries": 2, "reward/fallbacks": 0}
    assert len(sleeps) == 2
    assert judge.auth_headers[0] == "Bearer sk-test-123"


def test_a_model_that_is_not_found_falls_back_without_retrying():
    with ScriptedJudge({"judge-a": ["404"], "judge-b": ["ok:0.25"]}) as judge:
        value, counts = client(judge).score(PROMPT, "b")
    assert value == 0.25
    assert judge.requests == [("judge-a", "404"), ("judge-b", "ok:0.25")]
    assert counts == {"reward/judge_requests": 2, "reward/retries": 0, "reward/fallbacks": 1}


def test_a_refused_request_moves_down_the_chain_at_once():
    with ScriptedJudge({"judge-a": ["401"]}) as judge:
        value, counts = client(judge).score(PROMPT, "b")
    assert value == 0.5 and counts["reward/fallbacks"] == 1 and judge.count("judge-a") == 1


def test_a_model_that_keeps_failing_falls_back_after_its_retries():
    with ScriptedJudge({"judge-a": ["500"] * 10, "judge-b": ["ok:1"]}) as judge:
        value, counts = client(judge, max_retries=1).score(PROMPT, "b")
    assert value == 1.0 and judge.count("judge-a") == 2 and judge.count("judge-b") == 1
    assert counts == {"reward/judge_requests": 3, "reward/retries": 1, "reward/fallbacks": 1}


def test_when_the_whole_chain_fails_the_requests_are_bounded_and_the_error_names_each_model():
    with ScriptedJudge(default="500") as judge:
        with pytest.raises(JudgeError) as caught:
            client(judge, models=("judge-a", "judge-b", "judge-c"), max_retries=2).score(PROMPT, "b")
    assert len(judge.requests) == 3 * (1 + 2)  # models x (1 + max_retries), then it stops
    text = str(caught.value)
    assert all(f"judge-{x}: HTTP 500 (after 2 retries)" in text for x in "abc")
    assert "sk-test-123" not in text


def test_retry_after_is_honoured_up_to_the_backoff_cap():
    with ScriptedJudge({"judge-a": ["429:0.03", "429:30", "ok:0.5"]}) as judge:
        sleeps: list[float] = []
        client(judge, sleeps=sleeps).score(PROMPT, "b")
    assert sleeps == [0.03, 0.05]  # 30 s is capped at backoff_max_s


def test_backoff_doubles_up_to_the_cap_with_jitter_below_it():
    spec = JudgeSpec(backoff_s=0.5, backoff_max_s=3.0, jitter=0.5)
    rng = random.Random(0)
    for retry, ceiling in enumerate([0.5, 1.0, 2.0, 3.0, 3.0]):
        draws = [backoff_delay_s(retry, spec, rng) for _ in range(200)]
        assert all(ceiling * 0.5 <= d <= ceiling for d in draws)
        assert max(draws) - min(draws) > 0.2 * ceiling  # jitter spreads clients out
    assert backoff_delay_s(2, JudgeSpec(backoff_s=0.5, backoff_max_s=3.0, jitter=0.0), rng) == 2.0


def test_a_batch_is_scored_concurrently_with_failures_kept_apart(monkeypatch):
    monkeypatch.setenv("RLSPEC_TEST_JUDGE_KEY", "sk-test-456")
    with ScriptedJudge({"judge-a": ["every:3:500"] * 100}) as judge:
        spec = TaskSpec(name="copy_char", reward="llm_judge", judge=JudgeSpec(
            base_url=judge.base_url, models=["judge-a"], api_key_env="RLSPEC_TEST_JUDGE_KEY", max_retries=0,
            max_concurrency=4, timeout_s=5.0))
        task = build_task(spec, seed=0)
        prompts = task.sample(0, 12)
        scores = score(task, [f"x{i}" for i in range(12)], prompts)
    assert len(judge.requests) == 12  # max_retries=0: one request per sample
    assert len(scores.errors) == 4 and all(isinstance(e, JudgeError) for _, e in scores.errors)
    assert int(scores.valid.sum()) == 8 and scores.metrics["reward/judge_requests"] == 12
    assert set(judge.auth_headers) == {"Bearer sk-test-456"}


def test_judge_spec_errors_name_the_key(monkeypatch):
    with pytest.raises(SpecError, match=r"rollout.task.judge.base_url"):
        TaskSpec(reward="llm_judge", judge=JudgeSpec(models=["m"]))
    with pytest.raises(SpecError, match=r"rollout.task.judge.models"):
        TaskSpec(reward="llm_judge", judge=JudgeSpec(base_url="http://127.0.0.1:1/v1"))
    with pytest.raises(SpecError, match=r"rollout.task.reward_kwargs"):
        TaskSpec(reward="llm_judge", reward_kwargs={"target_len": 4}, judge=JudgeSpec(base_url="http://x/v1", models=["m"]))
    with pytest.raises(SpecError, match=r"rollout.task.reward"):
        TaskSpec(reward="judge")
    with pytest.raises(SpecError, match=r"rollout.task.judge.jitter"):
        JudgeSpec(jitter=1.5)
    judge = JudgeSpec(base_url="http://127.0.0.1:1/v1", models=["m"], api_key_env="RLSPEC_TEST_UNSET_KEY")
    monkeypatch.delenv("RLSPEC_TEST_UNSET_KEY", raising=False)
    with pytest.raises(SpecError, match=r"rollout.task.judge.api_key_env.*RLSPEC_TEST_UNSET_KEY is not set"):
        build_task(TaskSpec(reward="llm_judge", judge=judge), 0)
    ok = dict(base_url="http://127.0.0.1:1/v1", models=["m"], api_key_env=None)
    with pytest.raises(SpecError, match=r"prompt_template.*'answer'.*letter"):
        build_task(TaskSpec(reward="llm_judge", judge=JudgeSpec(prompt_template="{answer} {completion}", **ok)), 0)
    with pytest.raises(SpecError, match=r"score_regex.*capturing group"):
        build_task(TaskSpec(reward="llm_judge", judge=JudgeSpec(score_regex=r"SCORE: \d+", **ok)), 0)


def test_cli_run_with_a_flaky_judge_drops_samples_and_fails_past_the_rate(tmp_path, monkeypatch, capfd):
    """End to end through `rlspec run` (in-process): every 4th judge call fails and is not retried, so 16 of
    the 32 samples of each step have no reward."""
    from rlspec.cli import main

    secret = "sk-never-log-this-7f3a"
    monkeypatch.setenv("RLSPEC_TEST_JUDGE_KEY", secret)
    monkeypatch.chdir(REPO)
    with ScriptedJudge({"judge-a": ["every:4:500"] * 1000}) as judge:
        common = ["run", "examples/tiny.yaml", "algorithm.steps=2", "rollout.prompts_per_step=4", "rollout.task.reward=llm_judge",
                  "~rollout.task.reward_kwargs.target_len", f"rollout.task.judge.base_url={judge.base_url}",
                  "rollout.task.judge.models=[judge-a]", "rollout.task.judge.api_key_env=RLSPEC_TEST_JUDGE_KEY",
                  "rollout.task.judge.max_retries=0", "--no-progress"]
        ok = main([*common, "rollout.task.max_reward_error_rate=0.3", "--out", str(tmp_path / "ok")])
        ok_out = capfd.readouterr()
        failed = main([*common, "rollout.task.max_reward_error_rate=0.2", "--out", str(tmp_path / "bad")])
        failed_out = capfd.readouterr()
    assert ok == 0, ok_out.err
    rows = read_metrics(tmp_path / "ok" / "metrics.jsonl")
    assert [r["reward/errors"] for r in rows] == [8, 8] and all(r["reward/dropped"] >= 8 for r in rows)
    assert all(r["reward/mean"] == pytest.approx(0.5) for r in rows)  # the failures are not scored 0
    assert failed == 1
    assert "rollout.task.max_reward_error_rate=0.2" in failed_out.err and "8 of 32" in failed_out.err
    assert "HTTP 500" in failed_out.err
    for out in ("ok", "bad"):
        for path in (tmp_path / out).rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), path
    assert secret not in ok_out.err + ok_out.out + failed_out.err + failed_out.out
    plan = json.loads((tmp_path / "ok" / "plan.json").read_text())
    assert plan["spec"]["rollout"]["task"]["judge"]["api_key_env"] == "RLSPEC_TEST_JUDGE_KEY"
