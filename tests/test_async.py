"""`rollout.mode=async`: the pool, what the compiler refuses, equality with the synchronous run at zero
staleness, bounded staleness, and the lifecycle (the trainer decides the end; either loop's failure ends
the run with exit 1 and that loop's traceback)."""

from __future__ import annotations

import threading
import time

import pytest

from rlspec.core.async_loop import LockedEngine, Pool, PooledBatch
from rlspec.rollout.base import Rollout
from rlspec.cli import main
from rlspec.errors import RunError, SpecError
from rlspec.runtime.metrics import read_metrics
from rlspec.run import build_plan, run
from tests.conftest import REPO

FAST = ["algorithm.steps=4", "rollout.prompts_per_step=4", "hardware.num_threads=1", "checkpoint.every_n_steps=0"]
TIMING = ("timing_s/", "perf/", "sync/gb_per_s", "mem/peak_gb", "async/", )


def item(step: int) -> PooledBatch:
    return PooledBatch(step, None, 0, {}, {})  # type: ignore[arg-type]


def in_thread(fn, *args):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn(*args)), daemon=True)
    thread.start()
    return thread, out


def test_the_staleness_counts_the_version_a_server_reports_for_its_samples():
    """A rollout server labels each completion with the weights it was sampled with (a push waits for the rows in
    flight): the rollout loop's policy version is that label, and its own push count only where there is none."""
    class Engine:
        reported: int | None = None

        def generate(self, prompts, n, seed):
            return Rollout([[1]], [[2]], [[-0.5]], ["x"], weight_version=self.reported)

    engine = Engine()
    locked = LockedEngine(engine)
    locked.version = 4
    locked.generate(["p"], 1, 0)
    assert locked.sampled_version == 4  # no label: the version of the last push here
    engine.reported = 3  # e.g. a joined server that another trainer's push has not reached
    locked.generate(["p"], 1, 0)
    assert locked.sampled_version == 3


def test_pool_is_bounded_and_closing_wakes_every_waiter():
    pool = Pool(capacity=2, version=0)
    assert pool.put(item(0)) and pool.put(item(1))
    blocked_put, put_result = in_thread(pool.put, item(2))
    waiting_version, version_result = in_thread(pool.wait_for_version, 5)
    time.sleep(0.2)
    assert blocked_put.is_alive() and waiting_version.is_alive() and len(pool) == 2  # full: the third put waits
    assert pool.get().step == 0
    blocked_put.join(2)
    assert put_result["value"] is True and len(pool) == 2
    pool.set_version(4)
    time.sleep(0.1)
    assert waiting_version.is_alive()
    pool.close()
    waiting_version.join(2)
    assert version_result["value"] is False  # closed: the rollout loop stops waiting and ends
    assert pool.put(item(3)) is False
    assert [pool.get().step, pool.get().step] == [1, 2]  # what was produced is still handed out
    with pytest.raises(RunError, match="closed"):
        pool.get()


def test_a_rollout_loop_failure_reaches_the_trainer_with_its_traceback():
    pool = Pool(capacity=1, version=0)
    getter, out = in_thread(lambda: pytest.raises(RunError, pool.get))

    def failing_producer():
        raise ValueError("engine exploded")

    try:
        failing_producer()
    except ValueError as err:
        pool.fail(err)
    getter.join(2)
    text = str(out["value"].value)
    assert "the rollout loop failed: ValueError: engine exploded" in text and "failing_producer" in text


@pytest.mark.parametrize("overrides, key, needle", [
    (["rollout.mode=async", "rollout.max_staleness=1", "sync.method=shared"], "rollout.max_staleness",
     "sync.method=checkpoint"),
    (["rollout.mode=async", "rollout.max_staleness=1", "sync.method=checkpoint", "sync.every_n_steps=3"],
     "rollout.max_staleness", "rollout.max_staleness >= 2"),
    (["rollout.mode=later"], "rollout.mode", "sync, async"),
    (["rollout.mode=async", "rollout.max_staleness=-1"], "rollout.max_staleness", ">= 0"),
    (["algorithm.tis_cap=0.5"], "algorithm.tis_cap", ">= 1"),
])
def test_compiler_refuses_what_cannot_overlap(overrides, key, needle, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SpecError) as caught:
        build_plan("examples/tiny.yaml", overrides)
    assert caught.value.where == key and needle in str(caught.value)


def test_async_on_shared_weights_is_allowed_at_zero_staleness(monkeypatch):
    monkeypatch.chdir(REPO)
    plan, _ = build_plan("examples/tiny.yaml", ["rollout.mode=async", "rollout.max_staleness=0"])
    assert plan.sync_method == "shared"


def _run(tmp_path, name: str, *overrides: str):
    out = run("examples/tiny.yaml", [*FAST, *overrides], out=str(tmp_path / name), progress=False)
    return read_metrics(out / "metrics.jsonl")


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


@pytest.mark.parametrize("every, staleness", [(1, 0), (2, 1)])
def test_async_at_the_sync_lag_reproduces_the_synchronous_run(every, staleness, tmp_path, monkeypatch):
    """max_staleness = every_n_steps - 1 samples each batch with the weights sync mode would use: equal numbers."""
    monkeypatch.chdir(REPO)
    common = ["sync.method=checkpoint", f"sync.every_n_steps={every}", "algorithm.tis_cap=2.0"]
    sync_rows = _run(tmp_path, "sync", *common)
    async_rows = _run(tmp_path, "async", *common, "rollout.mode=async", f"rollout.max_staleness={staleness}")
    assert len(sync_rows) == len(async_rows) == 4
    for s, a in zip(sync_rows, async_rows):
        assert _numbers(s) == _numbers(a), s["step"]
    assert [a["async/staleness_mean"] for a in async_rows] == [float(step % every) for step in range(4)]
    assert all(a["tis/ratio_mean"] is not None and a["tis/clipped_frac"] is not None for a in async_rows)
    assert all("timing_s/wait" in a and "async/pool_size" in a for a in async_rows)


def test_staleness_and_pool_stay_bounded_and_the_trainer_runs_every_step(tmp_path, monkeypatch):
    """With max_staleness=3 the rollout loop may finish all batches first; the trainer still trains them all."""
    monkeypatch.chdir(REPO)
    rows = _run(tmp_path, "k3", "sync.method=checkpoint", "rollout.mode=async", "rollout.max_staleness=3")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(0 <= r["async/staleness_mean"] <= 3 and 0 <= r["async/pool_size"] <= 4 for r in rows)
    assert rows[0]["async/staleness_mean"] == 0


def _threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def test_a_failing_rollout_loop_ends_the_run_with_exit_1_and_its_traceback(tmp_path, monkeypatch, capsys):
    from rlspec.rollout.hf import HFEngine

    monkeypatch.chdir(REPO)
    calls = []
    original = HFEngine.generate

    def generate_then_fail(self, prompts, n, seed):
        calls.append(seed)
        if len(calls) == 3:
            raise RuntimeError("injected engine failure")
        return original(self, prompts, n, seed)

    monkeypatch.setattr(HFEngine, "generate", generate_then_fail)
    code = main(["run", "examples/tiny.yaml", *FAST, "sync.method=checkpoint", "rollout.mode=async",
                 "rollout.max_staleness=1", "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert "the rollout loop failed: RuntimeError: injected engine failure" in err
    assert "rollout_loop" in err and "generate_then_fail" in err  # the rollout loop's own traceback
    assert [r["step"] for r in read_metrics(tmp_path / "o" / "metrics.jsonl")] == [0, 1]
    assert not _threads_named("rlspec-rollout")


def test_a_failing_trainer_ends_the_run_with_exit_1_and_stops_the_rollout_loop(tmp_path, monkeypatch, capsys):
    from rlspec.core.trainer import LocalTrainer

    monkeypatch.chdir(REPO)
    steps = []
    original = LocalTrainer.optimizer_step

    def step_then_fail(self):
        steps.append(1)
        if len(steps) == 2:
            raise RuntimeError("injected trainer failure")
        return original(self)

    monkeypatch.setattr(LocalTrainer, "optimizer_step", step_then_fail)
    code = main(["run", "examples/tiny.yaml", *FAST, "sync.method=checkpoint", "rollout.mode=async",
                 "rollout.max_staleness=2", "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert "RuntimeError: injected trainer failure" in err and "step_then_fail" in err and "async_steps" in err
    assert "rollout loop failed" not in err
    assert not _threads_named("rlspec-rollout")  # the pool was closed and the rollout loop ended


def test_an_eval_follows_its_push_with_no_generation_between(tmp_path, monkeypatch):
    """The trainer evaluates under the hold of the engine it pushed with: the rollout loop, woken by the push, cannot
    generate first, so the trainer waits for the eval's own generation only (here the trainer also works for 0.1 s
    between the push and the eval, time in which the rollout loop would otherwise take the engine)."""
    from rlspec.core import async_loop
    from rlspec.rollout.hf import HFEngine

    monkeypatch.chdir(REPO)
    calls = []
    generate, push, row = HFEngine.generate, LockedEngine.push, async_loop.metrics_row

    def recorded_generate(self, prompts, n, seed, options=None):
        calls.append("eval" if options is not None else "rollout")
        return generate(self, prompts, n, seed, options=options)

    def recorded_push(self, *args):
        calls.append("push")
        return push(self, *args)

    monkeypatch.setattr(HFEngine, "generate", recorded_generate)
    monkeypatch.setattr(LockedEngine, "push", recorded_push)
    monkeypatch.setattr(async_loop, "metrics_row", lambda *a: (time.sleep(0.1), row(*a))[1])
    rows = _run(tmp_path, "o", "sync.method=checkpoint", "rollout.mode=async", "rollout.max_staleness=1",
                "eval.every_n_steps=1")
    assert all("eval/mean@1" in r for r in rows)
    assert calls.count("push") == 4 and all(calls[i + 1] == "eval" for i, c in enumerate(calls) if c == "push"), calls
