"""The GRPO step template, shared by every backend.

    sample prompts -> engine.generate -> rewards -> group advantages -> collate
      -> [old log-probs if several updates] -> [reference log-probs if KL]
      -> per mini-batch: backend.forward_backward + backend.optimizer_step
      -> sync weights to the engine (every N steps) -> metrics, checkpoint
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .backend import Backend, weight_source_of
from .batch import TrainBatch
from .checkpoints import Checkpoints
from .grpo import LossNorm, group_advantages, ragged_group_advantages
from .metrics import MetricsLog, peak_memory_gb
from .rollout.base import collate
from .spec import RunPlan
from .tasks import Task

if TYPE_CHECKING:
    from .agent.gateway import AgentGateway


@dataclass
class StepResult:
    batch: TrainBatch
    stats: dict[str, float]
    grad_norms: list[float]


class _Timer(dict):
    def __init__(self) -> None:
        super().__init__()
        self.extra: dict[str, float] = {}  # step metrics beyond the timings (`agent/*`), merged into the row

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self[name] = self.get(name, 0.0) + time.perf_counter() - start


def rollout_batch(plan: RunPlan, engine, task: Task, step: int, pad_id: int, timer: _Timer,
                  gateway: AgentGateway | None = None) -> TrainBatch:
    """Sample, score and collate one step's batch (prompts x group_size sequences; with an agent, the
    trajectories its gateway kept, and the gateway's `agent/*` counts in `timer.extra`)."""
    spec = plan.spec
    prompts = task.sample(step, plan.batch.prompts_per_step)
    with timer("gen"):
        if gateway is None:
            rollout = engine.generate([p.text for p in prompts], spec.algorithm.group_size, seed=spec.algorithm.seed + step)
            grouped = [p for p in prompts for _ in range(spec.algorithm.group_size)]
        else:
            agents = gateway.rollout(prompts, step)
            rollout, grouped = agents.rollout, agents.prompts
            timer.extra.update(agents.metrics)
    with timer("reward"):
        rewards = torch.tensor([task.reward(text, p) for text, p in zip(rollout.texts, grouped)], dtype=torch.float32)
    if gateway is None:
        advantages = group_advantages(rewards, spec.algorithm.group_size, spec.algorithm.adv_norm, spec.algorithm.adv_eps)
    else:
        advantages = ragged_group_advantages(rewards, agents.group_sizes, spec.algorithm.adv_norm, spec.algorithm.adv_eps)
    return collate(rollout, advantages, rewards, pad_id)


def update(plan: RunPlan, backend: Backend, batch: TrainBatch) -> StepResult:
    """All optimizer updates of one rollout batch (mini-batch after mini-batch)."""
    if plan.batch.updates_per_batch > 1:
        batch.old_logprobs = backend.logprobs(batch)
    if plan.needs_reference_model:
        batch.ref_logprobs = backend.logprobs(batch, reference=True)
    size = plan.batch.sequences_per_update
    totals: dict[str, float] = {}
    grad_norms = []
    for start in range(0, len(batch), size):
        mini = batch.select(start, start + size)
        norm = LossNorm.of(mini.loss_mask, plan.spec.rollout.max_new_tokens)
        stats = backend.forward_backward(mini, norm)
        grad_norms.append(backend.optimizer_step())
        for key, value in stats.items():  # sums over mini-batches; a peak is a peak
            totals[key] = max(totals.get(key, 0.0), value) if key == "peak_mem_gb" else totals.get(key, 0.0) + value
    return StepResult(batch, totals, grad_norms)


def metrics_row(plan: RunPlan, step: int, result: StepResult, timer: _Timer, sync_bytes: int) -> dict:
    stats, batch = result.stats, result.batch
    tokens = max(stats["tokens"], 1.0)
    updates = len(result.grad_norms)
    step_time = timer["step"]
    return {
        "step": step,
        "reward/mean": float(batch.rewards.mean()),
        "reward/std": float(batch.rewards.std()) if len(batch) > 1 else 0.0,
        "loss": stats["loss"] / updates,
        "kl": stats["kl_sum"] / tokens if plan.needs_reference_model else None,
        "grad_norm": sum(result.grad_norms) / updates,
        "clip_frac": stats["clipped_tokens"] / tokens,
        "entropy": stats["entropy_sum"] / tokens,
        "response_len/mean": float(batch.loss_mask.sum(-1).mean()),
        "timing_s/gen": timer.get("gen", 0.0),
        "timing_s/reward": timer.get("reward", 0.0),
        "timing_s/train": timer.get("train", 0.0),
        "timing_s/sync": timer.get("sync", 0.0),
        "timing_s/step": step_time,
        "perf/tokens_per_s": float(batch.attention_mask.sum()) / step_time if step_time > 0 else 0.0,
        "sync/bytes": sync_bytes,
        "sync/gb_per_s": sync_bytes / 1e9 / timer["sync"] if sync_bytes and timer.get("sync") else 0.0,
        "mem/peak_gb": stats.get("peak_mem_gb") or peak_memory_gb(plan.placement.device),
        **timer.extra,
    }


def _served_version(engine, steps_done: int) -> None:
    """Tell an engine that reports its weight version (a rollout server) which trainer step it now serves."""
    if hasattr(engine, "set_weight_version"):
        engine.set_weight_version(steps_done)


def train(plan: RunPlan, backend: Backend, task: Task, transport, out_dir: Path, pad_id: int,
          start_step: int = 0, progress: bool | None = None) -> None:
    """Run steps `start_step .. algorithm.steps - 1`; checkpoint every N steps and at the end."""
    spec = plan.spec
    engine = backend.rollout_engine()
    weights = weight_source_of(backend)
    transport.connect(engine, weights)
    # Resumed, or a joined rollout server: the engine holds other weights than the trainer's.
    if start_step or not getattr(engine, "starts_in_sync", True):
        transport.push(weights, engine)
        _served_version(engine, start_step)
    checkpoints = Checkpoints(out_dir / "checkpoints", spec.checkpoint.keep_last, spec.checkpoint.save_optimizer)
    log = MetricsLog(out_dir, spec.algorithm.steps, start_step, progress=progress)
    gateway = None
    if spec.rollout.agent.enabled:
        from .agent.gateway import AgentGateway

        gateway = AgentGateway(plan, engine)
    try:
        for step in range(start_step, spec.algorithm.steps):
            timer = _Timer()
            with timer("step"):
                batch = rollout_batch(plan, engine, task, step, pad_id, timer, gateway)
                with timer("train"):
                    result = update(plan, backend, batch)
                sync_bytes = 0
                if (step + 1) % spec.sync.every_n_steps == 0:
                    with timer("sync"):
                        sync_bytes = transport.push(weights, engine)
                    _served_version(engine, step + 1)
            log.log(metrics_row(plan, step, result, timer, sync_bytes))
            last = step == spec.algorithm.steps - 1
            every = spec.checkpoint.every_n_steps
            if last or (every and (step + 1) % every == 0):
                checkpoints.save(step, backend, {"backend": plan.backend})
    finally:
        if gateway is not None:
            gateway.close()
        log.close()
