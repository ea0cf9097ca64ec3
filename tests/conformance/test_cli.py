"""`rlspec conformance` end to end, in a subprocess: exit code, the JSON contract and the --dump artifacts."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from rlspec.conformance import JSON_KEYS


def _rlspec(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlspec.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_conformance_standalone_json_and_dump(tmp_path) -> None:
    out, dump = tmp_path / "conf.json", tmp_path / "dump"
    proc = _rlspec("conformance", "--backends", "standalone", "--json", str(out), "--dump", str(dump))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "conformance PASSED" in proc.stdout

    report = json.loads(out.read_text())
    assert report["checks"] and report["passed"] is True
    for check in report["checks"]:
        assert tuple(check) == JSON_KEYS
        assert check["backend"] == "standalone" and check["passed"] is True
    assert {c["transport"] for c in report["checks"]} == {None, "shared", "checkpoint", "nccl", "lora"}

    from transformers import AutoModelForCausalLM

    from rlspec.core.weights import tied_aliases

    model = AutoModelForCausalLM.from_pretrained(dump / "fixture" / "model", attn_implementation="eager")
    names = set(model.state_dict()) - tied_aliases(model)  # a tied weight is exported under its first name only
    batch = load_file(str(dump / "fixture" / "batch.safetensors"))
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask", "rewards"}
    assert batch["loss_mask"].sum() > 0 and torch.all(batch["loss_mask"] <= batch["attention_mask"])
    algorithms = json.loads((dump / "fixture" / "algorithm.json").read_text())
    assert algorithms["token_mean_sgd"]["optimizer"] == "sgd"

    for who in ("standalone", "reference"):
        rows = [json.loads(line) for line in (dump / who / "steps.jsonl").read_text().splitlines()]
        assert rows and all({"step", "loss", "grad_norm", "kl"} <= set(r) for r in rows)
        final = load_file(str(dump / who / "final.safetensors"))
        assert set(final) == names
    # a third party can verify independently: the backend's final weights against the reference's
    ours, ref = (load_file(str(dump / w / "final.safetensors")) for w in ("standalone", "reference"))
    assert max(float((ours[k] - ref[k]).abs().max()) for k in ref) < 1e-4


def test_unknown_backend_is_bad_input() -> None:
    proc = _rlspec("conformance", "--backends", "no_such_backend", timeout=120)
    assert proc.returncode == 2
    assert "no_such_backend" in proc.stderr
