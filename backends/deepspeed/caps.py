"""What the `deepspeed` backend can run, apart from its module so that `rlspec plan` reads it without importing
torch (registered under the entry point group `rlspec.backend_caps`)."""

from __future__ import annotations

from ...spec import BackendCaps

CAPS = BackendCaps(name="deepspeed", model_kinds=("causal_lm",), placements=("colocated", "separate"),
                   sync_methods=("ray", "nccl", "checkpoint", "cuda_ipc"), engines=("hf",), devices=("cpu", "cuda"),
                   supports_lora=False, keeps_master_weights=True, compiles_layers=True, requires=("deepspeed", "ray"),
                   install_hint="pip install 'rlspec[deepspeed]'")
