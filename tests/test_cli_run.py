"""`rlspec run` end to end through the real entry point: outputs, exit codes, refusal, resume, learning."""

from __future__ import annotations

import json
import statistics
import subprocess

import pytest
import torch

from rlspec.cli import _parser
from rlspec.runtime.metrics import METRIC_KEYS, read_metrics
from tests.conftest import REPO, rlspec_cmd


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(rlspec_cmd(*args), capture_output=True, text=True, cwd=REPO, timeout=600)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "out"
    proc = run_cli("run", "examples/tiny.yaml", "algorithm.steps=4", "checkpoint.every_n_steps=2",
                   "checkpoint.keep_last=0", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return out


def test_outputs_follow_the_contract(short_run):
    plan = json.loads((short_run / "plan.json").read_text())
    assert plan["backend"] == "standalone" and plan["spec"]["algorithm"]["steps"] == 4
    rows = read_metrics(short_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        assert set(METRIC_KEYS) <= set(row)
        assert row["kl"] is None  # kl_coef = 0: no reference model, nothing measured
        assert row["timing_s/step"] >= row["timing_s/gen"] + row["timing_s/train"]
        assert row["perf/tokens_per_s"] > 0 and row["mem/peak_gb"] > 0
    assert sorted(p.name for p in (short_run / "checkpoints").iterdir()) == ["step_000001", "step_000003"]
    assert list((short_run / "tensorboard").glob("events.out.tfevents.*"))


def test_checkpoint_loads_with_from_pretrained(short_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = short_run / "checkpoints" / "step_000003"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    assert tokenizer("a=").input_ids == [101, 65]
    saved = load_file(ckpt / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name])
    first = load_file(short_run / "checkpoints" / "step_000001" / "model.safetensors")
    assert any(not torch.equal(first[k], saved[k]) for k in saved), "weights should change between checkpoints"


def test_existing_run_is_refused_and_left_intact(short_run):
    before = (short_run / "metrics.jsonl").read_bytes()
    proc = run_cli("run", "examples/tiny.yaml", "algorithm.steps=4", "--out", str(short_run), "--no-progress")
    assert proc.returncode == 2 and "--out" in proc.stderr and "--resume" in proc.stderr
    assert (short_run / "metrics.jsonl").read_bytes() == before


def test_resume_continues_from_the_latest_checkpoint(short_run, tmp_path):
    import shutil

    out = tmp_path / "resumed"
    shutil.copytree(short_run, out)
    shutil.rmtree(out / "checkpoints" / "step_000003")  # pretend the run died after step 1's checkpoint
    proc = run_cli("run", "examples/tiny.yaml", "algorithm.steps=4", "checkpoint.every_n_steps=2",
                   "checkpoint.keep_last=0", "--out", str(out), "--resume", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    original = read_metrics(short_run / "metrics.jsonl")
    assert rows[2]["reward/mean"] == original[2]["reward/mean"]  # same sampling seed per step
    # A field that changes the math is refused, naming it, its old value and the fix; nothing is written.
    before = (out / "metrics.jsonl").read_bytes()
    refused = run_cli("run", "examples/tiny.yaml", "algorithm.steps=6", "algorithm.group_size=4", "--out", str(out),
                      "--resume")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "algorithm.group_size: is 4 now but 8 in the run" in refused.stderr
    assert "resume with algorithm.group_size=8" in refused.stderr
    assert (out / "metrics.jsonl").read_bytes() == before
    # Operational fields may change: run longer, checkpoint at the end only, another stall timeout.
    longer = run_cli("run", "examples/tiny.yaml", "algorithm.steps=5", "checkpoint.every_n_steps=0",
                     "hardware.stall_timeout_s=60", "--out", str(out), "--resume", "--no-progress")
    assert longer.returncode == 0, longer.stderr
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert json.loads((out / "plan.json").read_text())["spec"]["algorithm"]["steps"] == 5  # the plan now in force


def test_cuda_without_cuda_is_bad_input(tmp_path):
    """The plan cannot see the machine, but `run` can: no CUDA is bad input (exit 2), not a run failure."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = run_cli("run", "examples/tiny.yaml", "hardware.device=cuda", "--out", str(tmp_path / "o"), "--no-progress")
    assert proc.returncode == 2 and "hardware.device" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_cli_surface_is_frozen():
    """The flags are a public contract: adding one is fine, renaming or dropping one must show up here."""
    sub = {a.dest: a for a in _parser()._actions if a.dest == "command"}["command"]
    flags = {name: sorted(o for act in p._actions for o in act.option_strings if o not in ("-h", "--help"))
             for name, p in sub.choices.items()}
    assert flags == {
        "run": ["--backend", "--multirun", "--no-progress", "--out", "--resume", "-m"],
        "plan": ["--backend"],
        "serve": ["--allow-remote", "--backend", "--engine-index", "--engine-process", "--host", "--max-model-len",
                  "--max-queued-rows", "--parent-pid", "--port", "--shutdown-timeout-s", "--warm-pool"],
        "bench": ["--backends", "--multirun", "--out", "--reference", "--warmup-steps", "-m"],
        "conformance": ["--backends", "--dump", "--json"],
        "eval": ["--backend", "--checkpoint", "--checkpoints", "--model", "--multirun", "--out", "-m"],
    }


def test_tiny_example_learns(tmp_path):
    """The issue's criterion: last-10 mean reward >= 2x the first-10 mean and higher by >= 0.2."""
    out = tmp_path / "tiny"
    proc = run_cli("run", "examples/tiny.yaml", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    rewards = [r["reward/mean"] for r in read_metrics(out / "metrics.jsonl")]
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert last >= 2 * first and last - first >= 0.2, (first, last)
    # above 1/len(alphabet) = 0.25, the policy must be reading the prompt's letter
    assert last > 0.5, (first, last)
    # the spec's eval (greedy, every letter once, every 25 steps): 0.5, 0.53, then 1.0 from step 74 on when measured
    evals = [(r["step"], r["eval/mean@1"]) for r in read_metrics(out / "metrics.jsonl") if "eval/mean@1" in r]
    assert [s for s, _ in evals] == [24, 49, 74, 99, 124, 149] and evals[-1][1] >= 0.75, evals
    table = proc.stderr.split("rlspec: eval (", 1)[1].splitlines()[1:8]  # the run ends with a table of its evals
    assert table[0].split() == ["eval", "mean@1", "best@1", "response_len/mean", "truncated_frac"], table
    assert [(line.split()[0], float(line.split()[1])) for line in table[1:]] == \
        [(f"step_{s:06d}", pytest.approx(v, abs=5e-5)) for s, v in evals]


def test_bench_writes_table_json_and_plot(tmp_path):
    """A backend column with its own overrides (`name@key=value`); completion lengths beside the rates."""
    out = tmp_path / "bench"
    label = "standalone@model.eos_hazard=0.25"
    proc = run_cli("bench", "examples/tiny.yaml", "algorithm.steps=3", "--backends", label, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "bench.json").read_text())
    row = report["backends"][label]
    assert row["steps_measured"] == 2 and row["perf/tokens_per_s"] > 0
    assert 1 <= row["response_len/p50"] <= row["response_len/p90"] <= row["response_len/max"]
    assert row["response_len/mean"] < 5, "an end-token hazard of 0.25: mean 3.6 of 8 tokens (0: all 8)"
    assert "perf/tokens_per_s" in proc.stdout and "response_len/p90" in proc.stdout
    assert (out / "bench.png").stat().st_size > 0
    assert (out / "standalone+model.eos_hazard-0.25" / "metrics.jsonl").is_file()


def test_lora_run_resumes_exactly(tmp_path):
    """Resuming a LoRA run restores the adapters (not the merged weights) and continues identically."""
    pytest.importorskip("peft")
    args = ["examples/tiny.yaml", "algorithm.steps=3", "checkpoint.every_n_steps=1", "checkpoint.keep_last=0",
            "model.lora.r=4", "--no-progress"]
    full = tmp_path / "full"
    assert run_cli("run", *args, "--out", str(full)).returncode == 0
    part = tmp_path / "part"
    import shutil

    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step_000002")
    proc = run_cli("run", *args, "--out", str(part), "--resume")
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file

    a = load_file(full / "checkpoints" / "step_000002" / "model.safetensors")
    b = load_file(part / "checkpoints" / "step_000002" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def test_missing_backend_packages_are_bad_input():
    from rlspec.run import check_installed
    from rlspec.spec import BackendCaps, SpecError

    check_installed(BackendCaps("ok", requires=("json",)))
    with pytest.raises(SpecError, match=r"backend: backend x needs no_such_module_rlspec.*pip install 'rlspec\[x\]'"):
        check_installed(BackendCaps("x", requires=("no_such_module_rlspec",), install_hint="pip install 'rlspec[x]'"))


def test_vla_example_runs_env_rollouts(tmp_path):
    """A short run of the VLA example through the real entry point: env metrics, a checkpoint that loads back."""
    out = tmp_path / "vla"
    proc = run_cli("run", "examples/vla_babyai.yaml", "algorithm.steps=2", "rollout.prompts_per_step=1",
                   "algorithm.group_size=2", "rollout.env.max_steps=3", "algorithm.micro_batch_size=2",
                   "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert set(METRIC_KEYS) <= set(row)
        assert {"env/success_rate", "env/episode_len", "env/truncated", "env/errors", "timing_s/env"} <= set(row)
        assert row["env/episodes"] == 2 and row["env/errors"] == 0 and 1 <= row["env/episode_len"] <= 3
        assert row["timing_s/env"] > 0
    from transformers import AutoModelForImageTextToText, AutoProcessor

    ckpt = out / "checkpoints" / "step_000001"
    assert AutoModelForImageTextToText.from_pretrained(ckpt).config.model_type == "llava"
    assert AutoProcessor.from_pretrained(ckpt).tokenizer.vocab_size == 260
