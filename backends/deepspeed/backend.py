"""`deepspeed`: DeepSpeed ZeRO-3 trainer ranks as Ray actors (implementation in progress)."""

from __future__ import annotations

from ...errors import RunError
from ...spec import BackendCaps


class DeepSpeedBackend:
    caps = BackendCaps(name="deepspeed", model_kinds=("causal_lm",), placements=("colocated", "separate"),
                       sync_methods=("ray", "nccl", "checkpoint"), engines=("hf",), devices=("cpu", "cuda"),
                       supports_lora=False)

    def setup(self, plan) -> None:
        raise RunError("the deepspeed backend is not implemented yet")

    def shutdown(self) -> None:
        pass
