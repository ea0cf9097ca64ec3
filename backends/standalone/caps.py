"""What the `standalone` backend can run, apart from its module so that `rlspec plan` reads it without importing
torch (registered under the entry point group `rlspec.backend_caps`)."""

from __future__ import annotations

from ...spec import BackendCaps

CAPS = BackendCaps(name="standalone", model_kinds=("causal_lm", "vla"), placements=("colocated", "separate"),
                   sync_methods=("shared", "checkpoint", "nccl", "lora", "cuda_ipc"), engines=("hf",),
                   devices=("cpu", "cuda"), supports_lora=True, compiles_layers=True, max_trainer_ranks=1, single_process=True)
