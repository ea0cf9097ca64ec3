"""`rlspec run SPEC -m ...` and `rlspec bench SPEC -m ...`: Hydra's sweep expansion, one job per combination in
OUT/<n>/, a failed job leaving the others, a summary; bad syntax or a bad value in any job refuses the whole sweep."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rlspec.cli import main
from rlspec.spec import SpecError
from rlspec.sweep import expand
from tests.conftest import rlspec_cmd

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "examples" / "tiny.yaml")
FAST = ["algorithm.steps=2", "rollout.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=4",
        "rollout.max_new_tokens=4", "checkpoint.save_optimizer=false"]


def test_hydra_expands_every_combination():
    jobs, swept = expand(["algorithm.lr=1e-3,2e-3", "algorithm.seed=range(0,2)", "rollout.max_new_tokens=4",
                          "algorithm.kl_estimator=choice(k1,k3)"])
    assert swept == ["algorithm.lr", "algorithm.seed", "algorithm.kl_estimator"]
    assert len(jobs) == 8 and all("rollout.max_new_tokens=4" in job for job in jobs)
    assert jobs[0] == ["algorithm.lr=0.001", "algorithm.seed=0", "rollout.max_new_tokens=4", "algorithm.kl_estimator=k1"]
    assert len({tuple(job) for job in jobs}) == 8


def test_a_glob_sweeps_the_matching_presets_of_a_group():
    jobs, swept = expand(["model=glob(qwen2_*,exclude=qwen2_7b*)"])
    assert jobs == [["model=qwen2_0p5b_shape"], ["model=qwen2_1p5b_shape"], ["model=qwen2_24l_tiny"]] and swept == ["model"]
    with pytest.raises(SpecError, match="algorithm.lr is not one"):
        expand(["algorithm.lr=glob(1*)"])


@pytest.mark.parametrize("command", ["run", "bench"])
def test_bad_override_syntax_runs_nothing(command, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main([command, TINY, "-m", "algorithm.lr=[1e-3,2e-3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "rlspec: error: -m: cannot expand the sweep" in err and "Traceback" not in err
    assert not out.exists()


def test_a_bad_value_in_any_job_runs_nothing(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["run", TINY, *FAST, "-m", "algorithm.lr=1e-3,-1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "rlspec: error: algorithm.lr: must be > 0, got -1.0 (in sweep job 1: algorithm.lr=-1" in err, err
    assert not out.exists()


def _blocked(job_out: Path) -> None:
    """Make the job fail at its end: its checkpoint cannot be written where a file stands."""
    job_out.mkdir(parents=True)
    (job_out / "checkpoints").write_text("not a directory")


def _sweep(tmp_path: Path, swept: list[str], failing: int, *extra: str, command: str = "run"):
    out = tmp_path / "sweep"
    _blocked(out / str(failing))
    proc = subprocess.run(rlspec_cmd(command, TINY, *FAST, "-m", *swept, "--out", str(out), *extra),
                          capture_output=True, text=True, cwd=REPO, timeout=900)
    return out, proc, json.loads((out / "sweep.json").read_text())


def test_a_failed_job_leaves_the_next_one(tmp_path):
    out, proc, summary = _sweep(tmp_path, ["algorithm.lr=1e-3,2e-3"], 0, "--no-progress")
    assert proc.returncode == 1, proc.stderr
    assert "rlspec: 1 of 2 sweep jobs failed: 0 (algorithm.lr=0.001: exit 1)" in proc.stderr
    assert [job["exit_code"] for job in summary["jobs"]] == [1, 0] and summary["swept"] == ["algorithm.lr"]
    ok = summary["jobs"][1]
    assert ok["steps"] == 2 and isinstance(ok["final_reward_mean"], float) and ok["steps_per_s"] > 0
    recorded = json.loads((out / "1" / "overrides.json").read_text())
    assert recorded == ok["overrides"] and recorded[0] == "algorithm.steps=2" and recorded[-1] == "algorithm.lr=0.002"
    assert json.loads((out / "1" / "plan.json").read_text())["spec"]["algorithm"]["lr"] == 0.002
    table = proc.stdout[proc.stdout.index("job  swept"):].splitlines()  # after the jobs' own output
    assert table[0].split() == ["job", "swept", "exit", "final", "reward/mean", "steps/s", "wall", "s"]
    assert table[1].split()[:3] == ["0", "algorithm.lr=0.001", "1"] and table[2].split()[:3] == ["1", "algorithm.lr=0.002", "0"]


@pytest.mark.slow
def test_two_by_two_runs_four_jobs_and_a_failure_leaves_three(tmp_path):
    out, proc, summary = _sweep(tmp_path, ["algorithm.lr=1e-3,2e-3", "algorithm.seed=0,1"], 2, "--no-progress")
    assert proc.returncode == 1, proc.stderr
    assert [job["swept"] for job in summary["jobs"]] == [
        ["algorithm.lr=0.001", "algorithm.seed=0"], ["algorithm.lr=0.001", "algorithm.seed=1"],
        ["algorithm.lr=0.002", "algorithm.seed=0"], ["algorithm.lr=0.002", "algorithm.seed=1"]]
    assert [job["exit_code"] for job in summary["jobs"]] == [0, 0, 1, 0]
    assert all((out / str(n) / "metrics.jsonl").is_file() for n in range(4))


@pytest.mark.slow
def test_bench_takes_a_sweep(tmp_path):
    out = tmp_path / "sweep"
    proc = subprocess.run(rlspec_cmd("bench", TINY, *FAST, "-m", "rollout.max_new_tokens=4,8", "--out", str(out)),
                          capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "sweep.json").read_text())
    assert [job["exit_code"] for job in summary["jobs"]] == [0, 0]
    assert all(job["bench"]["standalone"]["perf/completion_tokens_per_s"] > 0 for job in summary["jobs"])
    assert all((out / str(n) / "bench.json").is_file() for n in range(2))
