"""`standalone`: one trainer process; the rollout engine in the same process or in a rollout server.

- In-process (`hardware.rollout=colocated`): with `sync.method=auto` (`shared`) trainer and `hf` engine
  share one copy of the weights and nothing moves. With `checkpoint`, `nccl` (gloo on CPU) or `lora` the
  engine holds its own copy and receives weights through the transport.
- Bridge (`hardware.rollout=separate`, or `sync.method=cuda_ipc`, which needs another process on the same
  GPU): the engine runs in an `rlspec serve` process that this backend starts (bound to 127.0.0.1, killed
  with its process group on every exit) or joins (`rollout.server_url`, which outlives the trainer). With
  `hardware.num_rollout_engines` = N > 1 it starts N servers, server i on the plan's engine device i, or
  joins the N of `rollout.server_urls`; each step's groups are split across them (`rlspec.serve.client`). The
  transport's engine half runs in the server through its bridge endpoint; sampling goes through its
  OpenAI-compatible `/v1/completions`. A joined server may hold another run's weights, so the loop pushes
  before the first rollout. A server lost mid-run is waited for (a started one is restarted) for up to
  `rollout.server_reconnect_s`; then the current weights are pushed and the interrupted requests re-run.

The trainer is `rlspec.core.trainer.LocalTrainer` — the same code the conformance suite uses as its reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from ...core.batch import TrainBatch
from ...core.grpo import LossNorm
from ...core.trainer import LocalTrainer
from ...core.weights import LocalWeights
from ...errors import RunError, SpecError
from ...models.factory import apply_lora, copy_weights, load_model
from ...rollout.hf import HFEngine
from ...spec import RunPlan
from .caps import CAPS

HEALTH_MARGIN_S = 10.0
"""Bridge calls may wait up to `sync.timeout_s` inside the server; the HTTP timeout allows for that."""


def uses_server(plan: RunPlan) -> bool:
    return plan.placement.rollout == "separate" or plan.sync_method == "cuda_ipc"


class StandaloneBackend:
    caps = CAPS

    def __init__(self) -> None:
        self.trainer: LocalTrainer | None = None
        self.engine = None
        self.servers: list = []

    def setup(self, plan: RunPlan) -> None:
        spec = plan.spec
        device = plan.placement.trainer_devices[0]
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RunError("hardware.device=cuda but no CUDA device is visible to this process")
        self.trainer = LocalTrainer(spec.model, spec.algorithm, spec.rollout.temperature, spec.rollout.max_new_tokens,
                                    device=device, needs_reference=plan.needs_reference_model)
        if uses_server(plan):
            self.engine = self._served_engine(plan)
            return
        engine_model = self.trainer.model
        if plan.sync_method == "lora":  # the engine's own base + adapters, built like the trainer's
            engine_model = apply_lora(load_model(spec.model, spec.algorithm.seed, device), spec.model, spec.algorithm.seed)
            engine_model = engine_model.to(device).eval().requires_grad_(False)
        elif plan.sync_method != "shared":
            # The engine holds a plain copy (LoRA merged away): it receives full weights by base-model name.
            engine_model = load_model(spec.model, spec.algorithm.seed, device).to(device).eval().requires_grad_(False)
            copy_weights(engine_model, self.trainer.export_weights())
        # In this process the engine's freed K/V blocks go straight to the trainer (no own_process: the allocator keeps
        # them cached); with its own copy of the weights, kv_cache_and_weights frees that too.
        release = spec.rollout.free_during_train if plan.sync_method != "shared" else "none"
        self.engine = HFEngine(engine_model, self.trainer.tokenizer, spec.rollout, device,
                               spec.algorithm.micro_batch_size, free_during_train=release)

    def _served_engine(self, plan: RunPlan):
        """One `ServedEngine` per server (started, or joined: `rollout.server_url(s)`); several behind
        `ServedReplicas`, which splits each step's groups across them."""
        from ...serve.process import ServerProcess
        from ...serve.client import ServedReplicas

        rollout = plan.spec.rollout
        urls = rollout.server_urls or ([rollout.server_url] if rollout.server_url is not None else [])
        if urls:
            keys = [f"rollout.server_urls[{i}]" for i in range(len(urls))] if rollout.server_urls else ["rollout.server_url"]
            engines = [self._joined(plan, url, key) for url, key in zip(urls, keys)]
        else:
            self.servers = [ServerProcess(plan, index=i) for i in range(len(plan.placement.engine_devices))]
            for server in self.servers:  # they load their models side by side
                server.start()
            engines = [self._started(plan, server) for server in self.servers]
        return engines[0] if len(engines) == 1 else ServedReplicas(engines, self.trainer.tokenizer, plan.dispatch.method,
                                                                   plan.dispatch.chunk_prompts)

    def _joined(self, plan: RunPlan, url: str, key: str):
        """A server this run joins; one that never answers at its address is bad input naming `key` (exit 2)."""
        from ...serve.client import ServedEngine, ServerClient

        rollout = plan.spec.rollout
        client = ServerClient(url, timeout_s=plan.spec.sync.timeout_s + HEALTH_MARGIN_S, transport=plan.sync_method)
        try:
            client.wait_healthy(rollout.server_start_timeout_s)
        except RunError as err:
            client.close()
            raise SpecError(key, f"no healthy rollout server at {url} ({err})",
                            "start `rlspec serve` there first, or fix the URL") from None
        return ServedEngine(client, self.trainer.tokenizer, rollout, starts_in_sync=False,
                            reconnect_s=rollout.server_reconnect_s, joined_as=key)

    def _started(self, plan: RunPlan, server):
        from ...serve.client import ServedEngine, ServerClient

        rollout = plan.spec.rollout
        client = ServerClient(server.url, server.token, plan.spec.sync.timeout_s + HEALTH_MARGIN_S, server.describe,
                              transport=plan.sync_method)
        client.wait_healthy(rollout.server_start_timeout_s, server.alive)
        return ServedEngine(client, self.trainer.tokenizer, rollout, starts_in_sync=True,
                            reconnect_s=rollout.server_reconnect_s, restart=server.restart)

    def rollout_engine(self):
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
        return LocalWeights(self.trainer.export_weights, adapters=self.trainer.export_adapters)

    def save(self, path: Path) -> None:
        self.trainer.save(path)

    def load(self, path: Path) -> None:
        self.trainer.load(path)

    def shutdown(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []
        if hasattr(self.engine, "replicas"):
            self.engine.close()
        elif getattr(self.engine, "client", None) is not None:
            self.engine.client.close()
        self.trainer = None
        self.engine = None
