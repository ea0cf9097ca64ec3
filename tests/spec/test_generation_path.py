"""The plan's `generation_path` (from the model type, without torch) and `rollout.free_during_train`'s checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlspec.spec import SpecError, compile_plan
from tests.spec.test_compile import CAPS, spec_with


@pytest.mark.parametrize("preset, device, want", [
    ("qwen3_0p6b_shape", "cuda", "cuda_graph"),
    ("gemma3_1b_shape", "cuda", "cuda_graph"),
    ("tiny_llama3", "cuda", "cuda_graph"),
    ("tiny_qwen2", "cpu", "plain (not on CUDA)"),
])
def test_generation_path_from_the_preset(preset, device, want):
    spec = spec_with(backend="multi", model={"preset": preset}, hardware={"device": device})
    assert compile_plan(spec, CAPS).generation_path == want


def test_generation_path_from_a_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    spec = spec_with(backend="multi", model={"path": str(tmp_path)}, hardware={"device": "cuda"})
    assert compile_plan(spec, CAPS).generation_path.startswith("plain (model_type 'gpt2' is not one of qwen2, qwen3")
    off = spec_with(backend="multi", model={"path": str(tmp_path)}, hardware={"device": "cuda"},
                    rollout={"cuda_graph": False})
    assert compile_plan(off, CAPS).generation_path == "plain (rollout.cuda_graph is false)"


def test_plan_imports_neither_torch_nor_transformers():
    code = ("import sys, json; from omegaconf import OmegaConf; from rlspec.spec import BackendCaps, Spec, compile_plan; "
            "spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Spec), {'backend': 'multi', "
            "'model': {'preset': 'qwen3_0p6b_shape'}, 'hardware': {'device': 'cuda'}})); "
            "plan = compile_plan(spec, {'multi': BackendCaps('multi', sync_methods=('cuda_ipc',))}); "
            "print(json.dumps([plan.generation_path, 'torch' in sys.modules, 'transformers' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ["cuda_graph", False, False]


@pytest.mark.parametrize("overrides, message", [
    ({"backend": "single"}, "sync.method=shared shares the trainer's"),
    ({"sync": {"every_n_steps": 2}}, "sync.every_n_steps=2"),
    ({"rollout": {"mode": "async", "free_during_train": "kv_cache_and_weights"}}, "rollout.mode=async"),
])
def test_freeing_the_weights_needs_a_full_push_before_every_rollout(overrides, message):
    sections = {"backend": "multi", "hardware": {"device": "cuda"}, **overrides}
    sections["rollout"] = {"free_during_train": "kv_cache_and_weights", **overrides.get("rollout", {})}
    with pytest.raises(SpecError) as err:
        compile_plan(spec_with(**sections), CAPS)
    assert err.value.where == "rollout.free_during_train" and message in str(err.value)
    fine = spec_with(backend="multi", hardware={"device": "cuda"}, rollout={"free_during_train": "kv_cache_and_weights"})
    assert compile_plan(fine, CAPS).sync_method == "cuda_ipc"


def test_free_during_train_names_its_values():
    with pytest.raises(SpecError) as err:
        spec_with(rollout={"free_during_train": "everything"})
    assert err.value.where == "rollout.free_during_train"
