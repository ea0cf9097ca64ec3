"""`standalone`: one trainer process; the rollout engine lives beside it.

Colocated (the mode implemented): trainer and `hf` engine share one copy of the weights in one process,
so `sync.method=auto` resolves to `shared` and nothing moves. With `sync.method=checkpoint` the engine
holds its own copy and receives weights through the transport, which exercises the weight path on CPU.
The trainer is `rlspec.trainer.LocalTrainer` — the same code the conformance suite uses as its reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from ...batch import TrainBatch
from ...errors import RunError
from ...grpo import LossNorm
from ...models import copy_weights, load_model
from ...rollout.hf import HFEngine
from ...spec import BackendCaps, RunPlan
from ...weights import LocalWeights
from ...trainer import LocalTrainer


class StandaloneBackend:
    caps = BackendCaps(name="standalone", model_kinds=("causal_lm", "vla"), placements=("colocated",),
                       sync_methods=("shared", "checkpoint"), engines=("hf",), devices=("cpu", "cuda"),
                       supports_lora=True, max_trainer_ranks=1, single_process=True)

    def __init__(self) -> None:
        self.trainer: LocalTrainer | None = None
        self.engine: HFEngine | None = None

    def setup(self, plan: RunPlan) -> None:
        spec = plan.spec
        device = plan.placement.trainer_devices[0]
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RunError("hardware.device=cuda but no CUDA device is visible to this process")
        self.trainer = LocalTrainer(spec.model, spec.algorithm, spec.rollout.temperature, spec.rollout.max_new_tokens,
                                    device=device, needs_reference=plan.needs_reference_model)
        engine_model = self.trainer.model
        if plan.sync_method != "shared":
            # The engine holds a plain copy (LoRA merged away): it receives full weights by base-model name.
            engine_model = load_model(spec.model, spec.algorithm.seed).to(device).eval().requires_grad_(False)
            copy_weights(engine_model, self.trainer.export_weights())
        self.engine = HFEngine(engine_model, self.trainer.tokenizer, spec.rollout, device, spec.algorithm.micro_batch_size)

    def rollout_engine(self) -> HFEngine:
        assert self.engine is not None, "setup() first"
        return self.engine

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        return self.trainer.logprobs(batch, reference)

    def forward_backward(self, batch: TrainBatch, norm: LossNorm) -> dict[str, float]:
        return self.trainer.forward_backward(batch, norm)

    def optimizer_step(self) -> float:
        return self.trainer.optimizer_step()

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        return self.trainer.export_weights()

    def weight_source(self) -> LocalWeights:
        return LocalWeights(self.trainer.export_weights)

    def save(self, path: Path) -> None:
        self.trainer.save(path)

    def load(self, path: Path) -> None:
        self.trainer.load(path)

    def shutdown(self) -> None:
        self.trainer = None
        self.engine = None
