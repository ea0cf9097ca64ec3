"""Bad files and machines are bad input too: `rlspec run` exits 2 with one line naming the key or file and
the fix, prints no traceback, and writes nothing. All in-process (`rlspec.cli.main`): refused before setup."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from rlspec.cli import main
from tests.conftest import REPO

TINY = str(REPO / "examples" / "tiny.yaml")
FAST = ["algorithm.steps=1", "rollout.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=4",
        "rollout.max_new_tokens=4"]


def refused(capsys, out: Path, *args: str, spec: str = TINY) -> str:
    """Run the CLI in-process; assert exit 2, one message line with a fix, no traceback, nothing under `out`."""
    code = main(["run", spec, *FAST, *args, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlspec:")]
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and " — " in lines[0], err
    assert not out.exists(), f"a refused run must write nothing, found {list(out.rglob('*'))}"
    return lines[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Hugging Face model directory: config, weights, tokenizer."""
    from rlspec.models.base import byte_tokenizer
    from rlspec.models.factory import load_model, save_hf
    from rlspec.spec.schema import ModelSpec

    path = tmp_path_factory.mktemp("model") / "tiny"
    save_hf(load_model(ModelSpec(), 0), byte_tokenizer(), path)
    return path


def broken_copy(model_dir: Path, tmp_path: Path, breaker) -> str:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    breaker(copy)
    return str(copy)


# --- the spec file ------------------------------------------------------------------------------------

def test_spec_not_text(tmp_path, capsys):
    spec = tmp_path / "exp.yaml"
    spec.write_bytes(bytes(range(256)) * 2)
    line = refused(capsys, tmp_path / "o", spec=str(spec))
    assert "exp.yaml" in line and "not UTF-8" in line


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_spec_empty_is_refused(tmp_path, capsys, text):
    spec = tmp_path / "exp.yaml"
    spec.write_text(text)
    line = refused(capsys, tmp_path / "o", spec=str(spec))
    assert "exp.yaml" in line and "empty" in line and "{}" in line


def test_spec_all_defaults_on_purpose_is_accepted(tmp_path, capsys):
    spec = tmp_path / "exp.yaml"
    spec.write_text("{}\n")
    assert main(["plan", str(spec)]) == 0


def test_spec_is_a_directory(tmp_path, capsys):
    (tmp_path / "exp.yaml").mkdir()
    assert "is a directory" in refused(capsys, tmp_path / "o", spec=str(tmp_path / "exp.yaml"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_spec_unreadable(tmp_path, capsys):
    spec = tmp_path / "exp.yaml"
    spec.write_text("algorithm: {steps: 1}\n")
    spec.chmod(0)
    assert "cannot be read" in refused(capsys, tmp_path / "o", spec=str(spec))


# --- --out -----------------------------------------------------------------------------------------------

def test_out_cannot_be_created(tmp_path, capsys):
    line = refused(capsys, Path("/proc/rlspec_no/such"))
    assert "--out" in line and "/proc/rlspec_no/such" in line


def test_out_under_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    line = refused(capsys, tmp_path / "f" / "run")
    assert "--out" in line
    assert (tmp_path / "f").read_text() == "x"


def test_out_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    code = main(["run", TINY, *FAST, "--out", str(tmp_path / "f")])
    err = capsys.readouterr().err
    assert code == 2 and "--out" in err and "is a file" in err and (tmp_path / "f").read_text() == "x"


# --- model.path -------------------------------------------------------------------------------------------

def _truncate(path: Path) -> None:
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _garbage_header(path: Path) -> None:
    (path / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a header" * 100)


def _no_tokenizer(path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink(missing_ok=True)


def _bad_config(path: Path) -> None:
    (path / "config.json").write_text("{not json")


def _other_model(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["hidden_size"] = 32  # weights stay those of hidden_size=64
    config["intermediate_size"] = 64
    (path / "config.json").write_text(json.dumps(config))


def _no_weights(path: Path) -> None:
    (path / "model.safetensors").unlink()


MODEL_CASES = {
    "truncated safetensors": (_truncate, "truncated"),
    "corrupt safetensors header": (_garbage_header, "model.safetensors"),
    "tokenizer missing": (_no_tokenizer, "no tokenizer"),
    "config.json not json": (_bad_config, "config.json"),
    "weights of another model": (_other_model, "another model"),
    "no weights": (_no_weights, "no weights"),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_path_problems(case, model_dir, tmp_path, capsys):
    breaker, needle = MODEL_CASES[case]
    path = broken_copy(model_dir, tmp_path, breaker)
    line = refused(capsys, tmp_path / "o", f"model.path={path}")
    assert "model.path" in line and needle in line, line


def test_intact_model_path_runs(model_dir, tmp_path, capsys):
    """The checks pass a good directory (and it trains from it)."""
    assert main(["run", TINY, *FAST, f"model.path={model_dir}", "--out", str(tmp_path / "o"), "--no-progress"]) == 0


# --- data files ---------------------------------------------------------------------------------------------

GSM8K = str(REPO / "examples" / "gsm8k.yaml")


def test_data_file_is_a_directory(tmp_path, capsys):
    (tmp_path / "data.jsonl").mkdir()
    line = refused(capsys, tmp_path / "o", f"rollout.task.data_path={tmp_path / 'data.jsonl'}", spec=GSM8K)
    assert "rollout.task.data_path" in line and "is a directory" in line


def test_data_file_not_text(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    line = refused(capsys, tmp_path / "o", f"rollout.task.data_path={tmp_path / 'data.jsonl'}", spec=GSM8K)
    assert "rollout.task.data_path" in line and "not UTF-8" in line


def test_data_record_not_an_object(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text('{"question": "1+1", "answer": "2"}\n[1, 2]\n')
    line = refused(capsys, tmp_path / "o", f"rollout.task.data_path={tmp_path / 'data.jsonl'}", spec=GSM8K)
    assert "record 2" in line


# --- the machine ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_cuda_is_bad_input(tmp_path, capsys):
    line = refused(capsys, tmp_path / "o", "hardware.device=cuda")
    assert "hardware.device" in line and "hardware.device=cpu" in line


# --- --resume -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resume") / "run"
    assert main(["run", TINY, *FAST, "algorithm.steps=2", "checkpoint.every_n_steps=1", "checkpoint.keep_last=0",
                 "--out", str(out), "--no-progress"]) == 0
    return out


def resume_refused(capsys, run: Path) -> str:
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    code = main(["run", TINY, *FAST, "algorithm.steps=2", "checkpoint.every_n_steps=1", "checkpoint.keep_last=0",
                 "--out", str(run), "--resume", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before, "a refused resume must change nothing"
    return err


def test_resume_checkpoint_of_another_model(finished_run, tmp_path, capsys):
    from rlspec.models.factory import save_hf

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    latest = run / "checkpoints" / "step_000001"
    other = tmp_path / "other"
    save_hf(_smaller_model(), None, other)
    shutil.copy(other / "model.safetensors", latest / "model.safetensors")
    err = resume_refused(capsys, run)
    assert "--resume" in err and "step_000001" in err and "another model" in err


def test_resume_truncated_checkpoint(finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    _truncate(run / "checkpoints" / "step_000001")
    err = resume_refused(capsys, run)
    assert "--resume" in err and "truncated" in err


def _smaller_model():
    """The tiny preset's architecture with one layer instead of two."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlspec.models.factory import PRESETS

    fields = {**PRESETS["tiny_qwen2"], "num_hidden_layers": 1}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
