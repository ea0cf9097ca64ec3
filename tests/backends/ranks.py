"""Helpers shared by the tests of the Ray rank-group backends (`deepspeed`, `fsdp`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from rlspec.core.batch import TrainBatch
from rlspec.core.grpo import LossNorm
from rlspec.core.trainer import LocalTrainer
from tests.conftest import interrupt_after_rows

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny.yaml"


def fixed_batch(n: int = 8, prompt: int = 5, max_new: int = 8, seed: int = 0) -> TrainBatch:
    """Random sequences with uneven completion lengths; rank 0's half has far more tokens than rank 1's."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [8, 7, 8, 6, 1, 2, 1, 3][:n]
    width = prompt + max(lengths)
    input_ids = torch.randint(4, 260, (n, width), generator=gen)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width)
    for i, length in enumerate(lengths):
        attention_mask[i, :prompt + length] = 1
        loss_mask[i, prompt:prompt + length] = 1
        input_ids[i, prompt + length:] = 0
    rewards = torch.rand(n, generator=gen)
    return TrainBatch(input_ids, attention_mask, loss_mask, advantages=torch.randn(n, generator=gen), rewards=rewards)


def ragged_batch(n: int) -> TrainBatch:
    """`n` rows (up to 16) of `fixed_batch`'s kind, for a batch whose size an agent's dropped trajectories set."""
    parts = [fixed_batch(min(n, 8), seed=0), *([fixed_batch(n - 8, seed=1)] if n > 8 else [])]
    return TrainBatch(**{k: torch.cat([p.tensors()[k] for p in parts]) for k in parts[0].tensors()})


UNEVEN_UPDATES = ((13, 2), (7, 4))
"""(rows, algorithm.updates_per_batch) of `check_uneven_updates`: mini-batches of 7 and 6 rows, then 2, 2, 2, 1."""


def check_uneven_updates(backend, reference, plan_with_updates) -> None:
    """`rlspec.core.step.update` on batches that split into mini-batches of odd row counts (`UNEVEN_UPDATES`), which
    the ranks share unevenly (a mini-batch of one row leaves a rank only placeholders): exactly `updates_per_batch`
    optimizer steps, each with the reference trainer's grad norm, and its weights after. `plan_with_updates(k)` is the
    plan with k updates per batch (the ranks keep the micro-batch size they were set up with)."""
    import pytest

    from rlspec.core.step import update

    for rows, updates in UNEVEN_UPDATES:
        plan = plan_with_updates(updates)
        want = update(plan, reference, ragged_batch(rows))
        got = update(plan, backend, ragged_batch(rows))
        assert len(got.grad_norms) == len(want.grad_norms) == updates
        assert got.grad_norms == pytest.approx(want.grad_norms, rel=1e-4, abs=1e-6)
        assert got.stats["loss"] == pytest.approx(want.stats["loss"], abs=1e-5)
    diff = max_weight_diff(dict(backend.export_weights()), dict(reference.export_weights()))
    print(f"  {len(UNEVEN_UPDATES)} updates of uneven mini-batches: max abs weight diff vs LocalTrainer {diff:.3g}")
    assert diff < 2e-5


def run_steps(trainer, plan, batch: TrainBatch, steps: int = 3, between=None) -> list[tuple[float, float, float]]:
    """(loss, grad norm, kl) per step, with old and reference log-probs filled the way `rlspec.core.loop` does;
    `between(trainer)` runs before every step but the first (where the loop pushes weights and samples)."""
    out = []
    for i in range(steps):
        if between is not None and i:
            between(trainer)
        step = TrainBatch(**batch.tensors())
        step.old_logprobs = trainer.logprobs(step) + 0.01 * step.loss_mask  # ratio != 1: the clip matters
        if plan.needs_reference_model:
            step.ref_logprobs = trainer.logprobs(step, reference=True)
        stats = trainer.forward_backward(step, LossNorm.of(step.loss_mask, plan.spec.rollout.max_new_tokens))
        out.append((stats["loss"], trainer.optimizer_step(), stats["kl_sum"] / stats["tokens"]))
    return out


def reference_trainer(plan) -> LocalTrainer:
    spec = plan.spec
    return LocalTrainer(spec.model, spec.algorithm, spec.rollout.temperature, spec.rollout.max_new_tokens,
                        needs_reference=plan.needs_reference_model)


def assert_same_steps(expected: list, got: list, trainer, reference) -> None:
    """`run_steps` results of a backend equal the reference trainer's: losses, grad norms, final weights."""
    import pytest

    for (l_ref, g_ref, _), (loss, grad_norm, _) in zip(expected, got, strict=True):
        assert loss == pytest.approx(l_ref, abs=1e-5)
        assert grad_norm == pytest.approx(g_ref, rel=1e-4, abs=1e-6)
    assert max_weight_diff(dict(trainer.export_weights()), dict(reference.export_weights())) < 1e-5


def max_weight_diff(have: dict, want: dict) -> float:
    assert set(have) == set(want), sorted(set(have) ^ set(want))[:5]
    return max(float((have[n].float() - want[n].float()).abs().max()) for n in want)


def rlspec_run(backend: str, out: Path, *overrides: str, env: dict | None = None, ranks: int = 2) -> subprocess.Popen:
    """`rlspec run examples/tiny.yaml` on `backend` in a subprocess (stdout and stderr piped)."""
    cmd = [sys.executable, "-m", "rlspec.cli", "run", str(TINY), "--backend", backend, "--out", str(out),
           "--no-progress", f"hardware.num_trainer_ranks={ranks}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})})


def actor_pids(root_pid: int, title: str) -> list[int]:
    """Pids of the Ray actor processes under `root_pid` whose command line names `title`."""
    import psutil

    pids = []
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            if title in " ".join(proc.cmdline()):
                pids.append(proc.pid)
        except Exception:  # noqa: BLE001 - the process went away
            pass
    return pids


def kill_a_rank_mid_run(backend: str, worker_title: str, out: Path) -> tuple[int, float, str]:
    """Run tiny.yaml on 2 ranks of `backend`, SIGKILL one rank actor after step 2; return the run's exit code,
    the seconds from the kill to the exit, and its stderr."""
    proc = rlspec_run(backend, out, "algorithm.steps=200")

    def kill_a_rank() -> None:
        pids = actor_pids(proc.pid, worker_title)
        assert len(pids) == 2, pids
        os.kill(max(pids), 9)

    err, elapsed = interrupt_after_rows(proc, out / "metrics.jsonl", 2, kill_a_rank, timeout_s=60)
    print(f"\nkilled a {backend} trainer rank; the run exited with {proc.returncode} after {elapsed:.1f} s; stderr ends:\n"
          + "\n".join(line for line in err.splitlines() if "rlspec" in line or "died" in line.lower())[-1500:])
    return proc.returncode, elapsed, err


def preempt_whole_tree(backend: str, out: Path, signum: int) -> None:
    """Run tiny.yaml (small steps) on 2 ranks of `backend`; after 2 steps send `signum` to the driver and every
    process under it at once (Ray's own, the rank and engine actors: what Slurm and Kubernetes do). The run must
    checkpoint its last completed step and exit 128 + signum; `--resume` (with more steps: an allowed change)
    then finishes."""
    import signal

    import psutil

    from rlspec.runtime.metrics import read_metrics

    small = ["rollout.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=1",
             "rollout.max_new_tokens=4", "checkpoint.every_n_steps=0",
             "hardware.preempt_grace_s=120"]  # 10-20 s from the signal to the exit on a busy 2-core machine
    proc = rlspec_run(backend, out, *small, "algorithm.steps=100")
    tree = []

    def signal_the_tree() -> None:
        tree.extend([psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)])
        for member in tree:
            try:
                member.send_signal(signum)
            except psutil.Error:
                pass

    err, took = interrupt_after_rows(proc, out / "metrics.jsonl", 2, signal_the_tree)
    name = signal.Signals(signum).name
    print(f"\n{name} to {len(tree)} processes of a {backend} run: exit {proc.returncode} {took:.1f} s later; "
          f"{[line for line in err.splitlines() if line.startswith('rlspec:')][-1:]}")
    assert proc.returncode == 128 + signum, err[-4000:]
    rows = read_metrics(out / "metrics.jsonl")
    last = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(last + 1)) and last >= 1
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{last:06d}"]
    assert f"{name}: stopped after step {last}" in err and "--resume" in err
    assert "died" not in err

    proc = rlspec_run(backend, out, *small, f"algorithm.steps={last + 3}", "--resume")
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-4000:]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(last + 3))


def assert_same_training(row: dict, resumed: Path) -> None:
    """The last step of the run resumed in `resumed` (which did not evaluate) trained exactly as `row`, the same
    step of the run that evaluated between its steps: every training number equal to the bit."""
    import json

    last = json.loads((resumed / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == row["step"]
    volatile = ("eval/", "timing_s/", "perf/", "mem/", "sync/gb_per_s")
    assert {k: v for k, v in last.items() if not k.startswith(volatile)} == \
        {k: v for k, v in row.items() if not k.startswith(volatile)}


def assert_rlspec_eval_reproduces(row: dict, checkpoint: Path, out: Path) -> None:
    """`rlspec eval` (in this process, on the CPU) on the run's checkpoint scores what the run's own eval of that step
    logged in `row`, to the bit: whichever backend trained and evaluated, a checkpoint is the same HF model."""
    import json

    from rlspec.evaluation.command import evaluate

    assert "eval/mean@1" in row, sorted(row)
    evaluate(str(TINY), [], checkpoints=[str(checkpoint)], out=str(out))
    metrics = json.loads((out / "eval.json").read_text())["results"][0]["metrics"]
    logged = {k: v for k, v in row.items() if k.startswith("eval/")}
    assert {k: v for k, v in metrics.items() if k.startswith("eval/")} == logged
