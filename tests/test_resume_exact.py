"""What a checkpoint must carry for `--resume` to continue the very run it stopped, and what it may not drop
silently: retention by step number, the tied head sent once, a warning where a resume changes a step's math,
seeded dropout, and exact resumes when the engine lags the trainer (sync and async)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from rlspec.cli import main
from rlspec.runtime.checkpoints import STATE_FILE, Checkpoints
from rlspec.runtime.metrics import read_metrics
from tests.conftest import REPO, interrupt_after_rows, rlspec_cmd

TINY = str(REPO / "examples" / "tiny.yaml")
SMALL = ["rollout.prompts_per_step=4", "algorithm.group_size=4", "algorithm.micro_batch_size=16",
         "checkpoint.keep_last=0"]
"""16 sequences of up to 8 tokens: the first steps of seed 0 have a reward, so a gradient."""


def cli(capsys, out: Path, *args: str) -> tuple[int, str]:
    code = main(["run", TINY, *SMALL, *args, "--out", str(out), "--no-progress"])
    return code, capsys.readouterr().err


def cli_process(out: Path, *args: str) -> str:
    """A run in a subprocess (the distributed backends); its stderr."""
    proc = subprocess.run(rlspec_cmd("run", TINY, *SMALL, *args, "--out", str(out), "--no-progress"), cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


# --- retention ---------------------------------------------------------------------------------------------------

class _Writer:
    def save(self, path: Path) -> None:
        (path / "model.safetensors").write_bytes(b"x")


def test_retention_orders_checkpoints_by_step_number_past_a_million(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep_last=2, save_optimizer=True)
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        checkpoints.save(step, _Writer(), {})
    assert [p.name for p in checkpoints.completed()] == ["step_1000000", "step_1000001"]
    assert checkpoints.latest().name == "step_1000001"


def test_a_crash_mid_save_leaves_nothing_once_a_run_starts(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep_last=0, save_optimizer=True)
    checkpoints.save(3, _Writer(), {})
    (tmp_path / ".staging_step_000004").mkdir()  # a crash while writing step 4
    (tmp_path / ".staging_step_000004" / "model.safetensors").write_bytes(b"half")
    checkpoints.save(3, _Writer(), {})
    (tmp_path / "step_000003").rename(tmp_path / ".replaced_step_000003")  # a crash between the two renames
    checkpoints.remove_leftovers()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003"]
    assert (tmp_path / "step_000003" / STATE_FILE).is_file()


# --- tied weights -------------------------------------------------------------------------------------------------

def _checkpoint_bytes(checkpoint: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for t in load_file(str(checkpoint / "model.safetensors")).values())


@pytest.mark.parametrize("backend", ["standalone",
                                     pytest.param("fsdp", marks=[pytest.mark.distributed, pytest.mark.slow]),
                                     pytest.param("deepspeed", marks=[pytest.mark.distributed, pytest.mark.slow])])
def test_a_tied_weight_crosses_the_wire_once(backend, tmp_path, capsys):
    """The tiny model ties its LM head to the embedding: a push moves what the checkpoint holds, not the
    embedding twice."""
    args = ["algorithm.steps=1", "sync.method=checkpoint", "--backend", backend]
    if backend == "standalone":
        assert cli(capsys, tmp_path / "o", *args)[0] == 0
    else:
        pytest.importorskip("ray")
        cli_process(tmp_path / "o", *args)
    (row,) = read_metrics(tmp_path / "o" / "metrics.jsonl")
    assert row["sync/bytes"] == _checkpoint_bytes(tmp_path / "o" / "checkpoints" / "step_000000")


# --- a resume that changes a step's math says so ------------------------------------------------------------------

def _warned(out: Path, err: str, needle: str) -> None:
    """The warning is printed, in the run log, and in the plan now in force."""
    assert needle in err
    assert needle in (out / "run.log").read_text()
    assert any(needle in w for w in json.loads((out / "plan.json").read_text())["resume_warnings"])


def test_resuming_without_optimizer_state_warns_and_records_it(tmp_path, capsys):
    out = tmp_path / "o"
    assert cli(capsys, out, "algorithm.steps=1", "checkpoint.save_optimizer=false")[0] == 0
    code, err = cli(capsys, out, "algorithm.steps=2", "checkpoint.save_optimizer=false", "--resume")
    assert code == 0, err
    _warned(out, err, "holds no optimizer state")


def test_resuming_with_optimizer_state_warns_nothing(tmp_path, capsys):
    out = tmp_path / "o"
    assert cli(capsys, out, "algorithm.steps=1")[0] == 0
    code, err = cli(capsys, out, "algorithm.steps=2", "--resume")
    assert code == 0 and "WARNING" not in err, err
    assert "resume_warnings" not in json.loads((out / "plan.json").read_text())


def _with_masters(checkpoint: Path) -> int:
    """Add fp32 master weights to a bf16 checkpoint's optimizer state, as fsdp and deepspeed write them (each the
    bf16 weight plus less than one bf16 step); the number of masters."""
    from safetensors.torch import load_file, save_file

    state = checkpoint / "optimizer" / "state.safetensors"
    tensors = load_file(str(state))
    weights = load_file(str(checkpoint / "model.safetensors"))
    names = [key.removesuffix(".exp_avg") for key in tensors if key.endswith(".exp_avg")]
    for name in names:
        weight = weights.get(name, weights.get("model.embed_tokens.weight")).float()
        noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
        tensors[f"{name}.master"] = weight + 1e-4 * noise
    save_file(tensors, str(state))
    return len(names)


def test_a_checkpoint_with_master_weights_resumed_on_standalone_is_not_silent(tmp_path, capsys):
    out = tmp_path / "o"
    assert cli(capsys, out, "algorithm.steps=1", "model.dtype=bfloat16")[0] == 0
    assert _with_masters(out / "checkpoints" / "step_000000")
    code, err = cli(capsys, out, "algorithm.steps=2", "model.dtype=bfloat16", "--resume")
    assert code == 0, err
    _warned(out, err, "fp32 master weights")


@pytest.mark.distributed
@pytest.mark.slow  # a Ray run; the standalone case above checks the same warning from a checkpoint made alike
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_a_bf16_sharded_checkpoint_resumed_on_standalone_warns(backend, tmp_path, capsys):
    pytest.importorskip("ray")
    out = tmp_path / "o"
    cli_process(out, "algorithm.steps=1", "model.dtype=bfloat16", "--backend", backend)
    code, err = cli(capsys, out, "algorithm.steps=2", "model.dtype=bfloat16", "--backend", "standalone", "--resume")
    assert code == 0, err
    _warned(out, err, "fp32 master weights")


# --- exact resumes --------------------------------------------------------------------------------------------------

VOLATILE = ("timing_s/", "perf/", "mem/", "sync/gb_per_s", "async/pool_size")
"""Metrics that measure the machine, not the run (how full the pool is when a step starts: how fast sampling was)."""


EVALUATED = ["eval.before_train=true", "eval.every_n_steps=2"]
"""The uninterrupted run also evaluates (the resumed one does not): an eval must not move a training number either."""


def assert_same_run(one: Path, other: Path) -> None:
    """Every metric of every step equal, to the bit (wall-clock figures aside; `one`'s eval rows and keys aside)."""
    want = [r for r in read_metrics(one / "metrics.jsonl") if r["step"] >= 0]
    got = read_metrics(other / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got):
        for key in a:
            if not key.startswith((*VOLATILE, "eval/")):
                assert b[key] == a[key], (a["step"], key, a[key], b[key])


def test_lora_dropout_is_seeded_and_resumes_exactly(tmp_path, capsys):
    lora = ["model.lora.r=4", "model.lora.dropout=0.1"]
    assert cli(capsys, tmp_path / "one", "algorithm.steps=2", *lora)[0] == 0
    assert cli(capsys, tmp_path / "resumed", "algorithm.steps=1", *lora)[0] == 0
    assert cli(capsys, tmp_path / "resumed", "algorithm.steps=2", *lora, "--resume")[0] == 0
    assert any(r["grad_norm"] > 0 for r in read_metrics(tmp_path / "one" / "metrics.jsonl"))
    assert_same_run(tmp_path / "one", tmp_path / "resumed")


LAGGING = {
    "sync_every_2": ["sync.method=checkpoint", "sync.every_n_steps=2"],
    "async_staleness_1": ["sync.method=checkpoint", "rollout.mode=async", "rollout.max_staleness=1"],
    "async_staleness_1_every_2": ["sync.method=checkpoint", "sync.every_n_steps=2", "rollout.mode=async",
                                  "rollout.max_staleness=1"],
}
"""Settings where the engine lags the trainer at the checkpoint after step 2 (its weights, or batches sampled ahead)."""
CADENCE = ["algorithm.steps=4", "checkpoint.every_n_steps=3", "hardware.num_threads=1"]


def _crash_at_step_3(monkeypatch) -> None:
    """The 4th update (step 3) fails: the run ends with exit 1 after the checkpoint of step 2."""
    from rlspec.core import async_loop, loop
    from rlspec.errors import RunError

    calls = []
    real = loop.update

    def update(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RunError("the machine went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "update", update)
    monkeypatch.setattr(async_loop, "update", update)


@pytest.mark.parametrize("mode", ["sync_every_2", "async_staleness_1",
                                  pytest.param("async_staleness_1_every_2", marks=pytest.mark.slow)])
def test_a_resume_while_the_engine_lags_equals_the_uninterrupted_run(mode, tmp_path, capsys, monkeypatch):
    """The interrupted and resumed run equals the uninterrupted one, which evaluates between steps (sync) or beside
    the rollout loop (async) while the other does not."""
    args = [*LAGGING[mode], *CADENCE]
    assert cli(capsys, tmp_path / "one", *args, *EVALUATED)[0] == 0
    assert sum("eval/mean@1" in r for r in read_metrics(tmp_path / "one" / "metrics.jsonl")) == 3
    with monkeypatch.context() as patch:
        _crash_at_step_3(patch)
        assert cli(capsys, tmp_path / "resumed", *args)[0] == 1
    code, err = cli(capsys, tmp_path / "resumed", *args, "--resume")
    assert code == 0, err
    assert_same_run(tmp_path / "one", tmp_path / "resumed")
    assert (tmp_path / "resumed" / "checkpoints" / "step_000002" / "engine" / "state.json").is_file()


@pytest.mark.distributed
@pytest.mark.slow  # three distributed runs each; the standalone cases above run the same loop code in CI
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
@pytest.mark.parametrize("mode", ["sync_every_2", "async_staleness_1"])
def test_a_distributed_resume_while_the_engine_lags_equals_the_uninterrupted_run(backend, mode, tmp_path):
    """The same on 2 ranks, the engines in Ray actors (the uninterrupted run evaluating on them). sync_every_2: the
    interrupted run ends at step 2, a push behind, and the resume extends it; async_staleness_1: SIGTERM stops it on
    whichever step, with the next batch already in the pool."""
    import signal

    pytest.importorskip("ray")
    args = [*LAGGING[mode], "checkpoint.every_n_steps=0", "algorithm.micro_batch_size=8", "--backend", backend,
            "hardware.num_trainer_ranks=2"]
    cli_process(tmp_path / "one", *args, "algorithm.steps=6", *EVALUATED)
    out = tmp_path / "resumed"
    if mode == "sync_every_2":
        cli_process(out, *args, "algorithm.steps=3")
    else:
        proc = subprocess.Popen(rlspec_cmd("run", TINY, *SMALL, *args, "algorithm.steps=6", "--out", str(out),
                                           "--no-progress"), cwd=REPO, stderr=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        err, _ = interrupt_after_rows(proc, out / "metrics.jsonl", 2, lambda: proc.send_signal(signal.SIGTERM))
        assert proc.returncode == 143, err[-4000:]
    assert list((out / "checkpoints").glob("step_*/engine/state.json"))
    cli_process(out, *args, "algorithm.steps=6", "--resume")
    assert_same_run(tmp_path / "one", out)
