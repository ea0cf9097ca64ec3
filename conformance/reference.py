"""The reference: the simplest GRPO step there is, single process, fp32, and the backend runner beside it.

The reference shares with the backends only what is under test elsewhere: the model factory, the
optimizer factory and the loss formula (`rlspec.core.grpo`, tested against a per-token loop). It does not
use the step template (`rlspec.core.step.update`) or the micro-batch loop (`rlspec.core.policy.accumulate`): it
computes each whole optimizer-step mini-batch in one padded forward, so a backend's micro-batching,
sharding and normalisation are compared with the plain formula, never with themselves.

A backend runs through the real step template, `rlspec.core.step.update`, driven only through the `Backend`
protocol.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.batch import TrainBatch
from ..core.grpo import LossConfig, LossNorm, policy_loss, read_stats
from ..core.policy import eval_mode, sequence_logprobs
from ..core.step import update
from ..core.trainer import LocalTrainer, grad_norm_and_clip
from ..spec import BackendCaps, Spec, compile_plan
from .fixture import Fixture


class SuiteError(RuntimeError):
    """The suite itself is wrong (e.g. a case that no longer exercises what it claims to)."""


@dataclass
class StepRecord:
    """One GRPO step on the fixture batch (`updates_per_batch` optimizer updates)."""

    step: int
    loss: float
    """Mean over the step's optimizer updates of the aggregated loss."""
    grad_norms: list[float]
    """Global grad norm before clipping, one per optimizer update."""
    kl: float | None
    """Mean per-token KL over the batch's completion tokens (None without a reference model)."""
    clip_frac: float

    def row(self) -> dict:
        """The `steps.jsonl` row."""
        return {"step": self.step, "loss": self.loss, "grad_norm": sum(self.grad_norms) / len(self.grad_norms),
                "kl": self.kl, "grad_norms": self.grad_norms, "clip_frac": self.clip_frac}


@dataclass
class CaseRun:
    steps: list[StepRecord]
    weights: dict[str, Tensor]
    """Full updated weights after the last step, by state-dict name."""


def _record(step: int, stats: dict[str, float], grad_norms: list[float], kl_on: bool) -> StepRecord:
    tokens = max(stats["tokens"], 1.0)
    return StepRecord(step, stats["loss"] / len(grad_norms), grad_norms,
                      stats["kl_sum"] / tokens if kl_on else None, stats["clipped_tokens"] / tokens)


@torch.no_grad()
def _logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float) -> Tensor:
    with eval_mode(model):  # as every backend's no-gradient pass
        return sequence_logprobs(model, batch, temperature)[0]


def run_reference(spec: Spec, fixture: Fixture) -> CaseRun:
    """The case's steps computed the plain way: one forward per optimizer step, no micro-batches, no ranks."""
    algo, temperature = spec.algorithm, spec.rollout.temperature
    kl_on = algo.kl_coef > 0
    whole = dataclasses.replace(algo, micro_batch_size=len(fixture.rewards))
    trainer = LocalTrainer(spec.model, whole, temperature, spec.rollout.max_new_tokens, "cpu", needs_reference=kl_on)
    model, cfg = trainer.model, LossConfig.from_algorithm(algo)
    per_update = len(fixture.rewards) // algo.updates_per_batch
    steps, dual_clipped = [], 0.0
    for step in range(algo.steps):
        batch = fixture.train_batch(algo)
        if kl_on:
            batch.ref_logprobs = _logprobs(trainer.reference, batch, temperature)
        if algo.updates_per_batch > 1:
            batch.old_logprobs = _logprobs(model, batch, temperature)
        totals = dict.fromkeys(("loss", "kl_sum", "tokens", "clipped_tokens"), 0.0)
        grad_norms = []
        for start in range(0, len(batch), per_update):
            mini = batch.select(start, start + per_update)
            norm = LossNorm.of(mini.loss_mask, spec.rollout.max_new_tokens)
            logp = sequence_logprobs(model, mini, temperature)[0]
            old = logp.detach() if mini.old_logprobs is None else mini.old_logprobs
            loss, stats = policy_loss(logp, old, mini.advantages, mini.loss_mask, norm, cfg, mini.ref_logprobs)
            loss.backward()
            grad_norms.append(float(grad_norm_and_clip(model.parameters(), algo.max_grad_norm)))
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            stats = read_stats(stats) | {"loss": float(loss.item())}
            for key in totals:
                totals[key] += stats[key]
            if algo.dual_clip_c is not None:
                ratio = torch.exp(logp.detach() - old)
                binding = (mini.advantages.unsqueeze(-1) < 0) & (ratio > algo.dual_clip_c) & (mini.loss_mask > 0)
                dual_clipped += float(binding.sum())
        steps.append(_record(step, totals, grad_norms, kl_on))
    _check_meaningful(spec, steps, dual_clipped)
    return CaseRun(steps, dict(trainer.export_weights()))


def _check_meaningful(spec: Spec, steps: list[StepRecord], dual_clipped: float) -> None:
    """Refuse a case whose knobs never act on the reference (it would pass on a backend that ignores them)."""
    algo = spec.algorithm
    if algo.updates_per_batch > 1 and not any(s.clip_frac > 0 for s in steps):
        raise SuiteError("updates_per_batch > 1 but the reference never clips a token: raise the lr or lower clip_eps")
    if algo.dual_clip_c is not None and dual_clipped == 0:
        raise SuiteError(f"dual_clip_c={algo.dual_clip_c} never binds in the reference: lower it")
    if algo.max_grad_norm > 0 and not any(g > algo.max_grad_norm for s in steps for g in s.grad_norms):
        raise SuiteError(f"max_grad_norm={algo.max_grad_norm} never clips in the reference: lower it")


def run_backend(name: str, backend_cls: type, spec: Spec, fixture: Fixture) -> CaseRun:
    """The case's steps on `backend_cls`, through `compile_plan` and the shared step template."""
    caps: BackendCaps = backend_cls.caps
    plan = compile_plan(spec, {name: caps})
    backend = backend_cls()
    try:
        backend.setup(plan)
        steps = []
        for step in range(plan.spec.algorithm.steps):
            result = update(plan, backend, fixture.train_batch(plan.spec.algorithm))
            steps.append(_record(step, result.stats, result.grad_norms, plan.needs_reference_model))
        weights = {n: t.detach().to("cpu", torch.float32).clone() for n, t in backend.export_weights()}
    finally:
        backend.shutdown()
    return CaseRun(steps, weights)
