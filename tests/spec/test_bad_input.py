"""Every class of bad input exits 2 with one message naming the key (or file:line) and a fix."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rlspec.cli import main
from tests.conftest import REPO, rlspec_cmd

TINY = str(REPO / "examples" / "tiny.yaml")


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def run_plan(capsys, *args: str) -> tuple[int, str]:
    code = main(["plan", *args])
    err = capsys.readouterr().err
    return code, err


CASES = {
    # name: (yaml text or None for examples/tiny.yaml, overrides, text the message must contain)
    "unknown key in yaml": ("algorithm:\n  lrr: 0.1\n", [], "algorithm.lrr"),
    "unknown section in yaml": ("algorithmz:\n  lr: 0.1\n", [], "algorithmz"),
    "unknown key in override": (None, ["algorithm.lrr=0.1"], "algorithm.lrr"),
    "unknown nested key in override": (None, ["model.lora.rank=4"], "model.lora.rank"),
    "appended unknown key": (None, ["+algorithm.foo=1"], "algorithm.foo"),
    "new key in a mapping without +": (None, ["rollout.task.dataset_kwargs.repeat=8"], "+rollout.task.dataset_kwargs.repeat"),
    "wrong type in yaml": ("algorithm:\n  group_size: many\n", [], "algorithm.group_size"),
    "wrong type in override": (None, ["algorithm.lr=fast"], "algorithm.lr"),
    "out of range": (None, ["algorithm.group_size=1"], "algorithm.group_size"),
    "negative lr": (None, ["algorithm.lr=-1e-5"], "algorithm.lr"),
    "top_p out of range": (None, ["rollout.top_p=1.5"], "rollout.top_p"),
    "bad choice": (None, ["algorithm.loss_agg=token-sum"], "algorithm.loss_agg"),
    "unknown backend": (None, ["backend=megatron"], "backend"),
    "unknown preset": (None, ["model=llama_70b"], "model"),
    "unknown model preset name": (None, ["model.preset=nope"], "model.preset"),
    "impossible: cuda_ipc on separate": (None, ["sync.method=cuda_ipc"], "sync.method"),
    "impossible: vla on deepspeed": (None, ["model=tiny_llava", "backend=deepspeed"], "model.kind"),
    "vla without an environment": (None, ["model=tiny_llava"], "rollout.env.name"),
    "environment with a causal lm": (None, ["rollout.env.name=minigrid"], "rollout.env.name"),
    "impossible: ranks on standalone": (None, ["hardware.num_trainer_ranks=2"], "hardware.num_trainer_ranks"),
    "impossible: batch split": (None, ["algorithm.updates_per_batch=5"], "algorithm.updates_per_batch"),
    "negative token budget": (None, ["algorithm.micro_batch_tokens=-1"], "algorithm.micro_batch_tokens"),
    "negative module granularity": (None, ["hardware.deepspeed.module_granularity_numel=-1"],
                                    "hardware.deepspeed.module_granularity_numel"),
    "compiled layers of a vla": (None, ["model=tiny_llava", "model.compile_layers=true"], "model.compile_layers"),
    "zero reduce bucket": (None, ["hardware.deepspeed.reduce_bucket_numel=0"], "hardware.deepspeed.reduce_bucket_numel"),
    "negative persistence threshold": (None, ["hardware.deepspeed.param_persistence_numel=-1"],
                                       "hardware.deepspeed.param_persistence_numel"),
    "zero stage 0": (None, ["hardware.deepspeed.zero_stage=0"], "hardware.deepspeed.zero_stage"),
    "impossible: parameter offload under zero 2": (None, ["backend=deepspeed", "hardware.device=cuda",
                                                          "hardware.offload_params=true", "hardware.deepspeed.zero_stage=2"],
                                                   "hardware.offload_params=true with hardware.deepspeed.zero_stage=2"),
    "impossible: micro batch too big": (None, ["algorithm.micro_batch_size=100"], "algorithm.micro_batch_size"),
    "impossible: vllm on cpu": (None, ["rollout.engine=vllm"], "rollout.engine"),
    "missing model directory": (None, ["model.path=/nonexistent/model"], "model.path"),
    "missing data file": (None, ["rollout.task.name=gsm8k", "rollout.task.data_path=/nonexistent.jsonl"], "rollout.task.data_path"),
    "unknown key of a listed reward": (None, ["rollout.task.rewards=[{fn: a.py:f}]"], "rollout.task.rewards[].fn"),
    "wrong type in a listed reward": (None, ["rollout.task.rewards=[{function: a.py:f, weight: x}]"],
                                      "rollout.task.rewards[].weight"),
    "unknown reward kwarg": (None, ["+rollout.task.reward_kwargs.targetlen=3"], "rollout.task.reward_kwargs.targetlen"),
    "unknown task": (None, ["rollout.task.name=chess"], "rollout.task.name"),
    "bad override syntax": (None, ["algorithm.lr=="], "override"),
    "yaml syntax error": ("algorithm:\n  lr: [1e-3\nmodel: {}\n", [], "exp.yaml:"),
    "yaml not a mapping": ("- 1\n- 2\n", [], "exp.yaml"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_exits_2_naming_the_key(name, tmp_path, capsys):
    text, overrides, needle = CASES[name]
    spec = TINY if text is None else write(tmp_path, text)
    code, err = run_plan(capsys, spec, *overrides)
    assert code == 2, err
    assert needle in err
    assert "Traceback" not in err
    assert err.count("\n") == 1, f"one message line expected, got: {err!r}"
    assert " — " in err, "the message should say how to fix it"


def test_missing_spec_file(capsys, tmp_path):
    code, err = run_plan(capsys, str(tmp_path / "nope.yaml"))
    assert code == 2 and "nope.yaml" in err and "not found" in err


def test_yaml_error_names_the_line(tmp_path, capsys):
    spec = write(tmp_path, "algorithm:\n  lr: 1e-3\n  steps: [3\n")
    code, err = run_plan(capsys, spec)
    assert code == 2 and "exp.yaml:4" in err or "exp.yaml:3" in err


def test_real_entry_point_exit_code_and_nothing_written(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(rlspec_cmd("run", TINY, "algorithm.lrr=1", "--out", str(out)),
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert "algorithm.lrr" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists(), "a refused spec must not create the output directory"
