"""The pieces of a GRPO step, shared by the synchronous loop (`rlspec.core.loop`) and the asynchronous
one (`rlspec.core.async_loop`): sample and score a batch, update the policy on it, one metrics row.

A reward that raises (or is not a finite number) is counted in `reward/errors` and its sample is
dropped — kept in the tensors so the batch still splits as planned, but with no loss tokens; its
group's advantages are renormalised over the members left (`rlspec.core.grpo.kept_samples`). Past
`rollout.task.max_reward_error_rate` of a step's samples the run fails.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import RunError
from ..rollout.base import collate, engine_logprobs_tensor
from ..runtime.metrics import PhaseTimer, gpu_used_gb, peak_memory_gb
from ..spec import RunPlan
from ..tasks import Scores, Task, score
from .backend import Backend
from .batch import TrainBatch
from .grpo import LossNorm, group_advantages, kept_samples, ragged_group_advantages
from .policy import PEAK_STATS

if TYPE_CHECKING:
    from ..agent.gateway import AgentGateway


@dataclass
class StepResult:
    batch: TrainBatch
    stats: dict[str, float]
    grad_norms: list[float]
    skipped: int = 0
    """Mini-batch updates skipped: nothing to learn (`nothing_to_learn`)."""
    skip_reason: str | None = None
    """Why the step took no optimizer step at all (`SKIP_REASONS`); None when it took one."""


SKIP_REASONS = {"dropped": "every sample was dropped", "zero_advantage": "every advantage is zero"}
"""`update/skip_reason` of a metrics row whose step took no optimizer step."""


def rollout_batch(plan: RunPlan, engine, task: Task, step: int, pad_id: int, timer: PhaseTimer,
                  gateway: AgentGateway | None = None) -> tuple[TrainBatch, dict[str, float]]:
    """Sample, score and collate one step's batch (prompts x group_size sequences; with an agent, the
    trajectories its gateway kept); also the step's counters (`reward/*`, the gateway's `agent/*`)."""
    spec = plan.spec
    group_size = spec.algorithm.group_size
    prompts = task.sample(step, plan.batch.prompts_per_step)
    with timer("gen"):
        if gateway is None:
            rollout = engine.generate([p.text for p in prompts], group_size, seed=spec.algorithm.seed + step)
            grouped, group_sizes, agent_counts = [p for p in prompts for _ in range(group_size)], None, {}
        else:
            agents = gateway.rollout(prompts, step)
            rollout, grouped, group_sizes, agent_counts = agents.rollout, agents.prompts, agents.group_sizes, agents.metrics
    with timer("reward"):
        scores = score(task, rollout.texts, grouped, rollout.completion_ids)
    check_reward_errors(scores, spec.rollout.task.max_reward_error_rate, step)
    algo = spec.algorithm
    if group_sizes is None:
        kept = kept_samples(scores.valid, group_size)
        advantages = group_advantages(scores.rewards, group_size, algo.adv_norm, algo.adv_eps, kept)
    else:  # an agent's groups lost their failed trajectories already: each group is normalised on its own
        kept = torch.cat([kept_samples(v, len(v)) for v in scores.valid.split(group_sizes)])
        advantages = ragged_group_advantages(scores.rewards, group_sizes, algo.adv_norm, algo.adv_eps, kept)
    batch = collate(rollout, advantages, scores.rewards, pad_id)
    batch.loss_mask[~kept] = 0.0
    batch.engine_logprobs = engine_logprobs_tensor(rollout, batch)
    counters = {**agent_counts, **scores.metrics, "reward/errors": float(len(scores.errors)),
                "reward/dropped": float((~kept).sum())}
    return batch, counters


def check_reward_errors(scores: Scores, max_rate: float, step: int) -> None:
    """Raise `RunError` when more than `max_rate` of the samples have no reward (naming the spec key)."""
    if not scores.errors:
        return
    total = len(scores.rewards)
    rate = len(scores.errors) / total
    if rate > max_rate:
        index, first = scores.errors[0]
        raise RunError(f"the reward failed for {len(scores.errors)} of {total} samples at step {step} ({rate:.1%}), "
                       f"more than rollout.task.max_reward_error_rate={max_rate} allows; first failure (sample {index}): "
                       f"{type(first).__name__}: {first}",
                       "".join(traceback.format_exception(type(first), first, first.__traceback__)))


def update(plan: RunPlan, backend: Backend, batch: TrainBatch) -> StepResult:
    """All optimizer updates of one rollout batch (mini-batch after mini-batch).

    The batch splits into exactly `algorithm.updates_per_batch` consecutive mini-batches, as equal as its rows
    allow (`mini_batch_bounds`): an agent's batch loses its failed trajectories, so its row count varies per step.
    Each mini-batch's loss is normalised over that mini-batch (`LossNorm`).

    A mini-batch without a loss token (every sample in it dropped) is always skipped: its loss has no
    gradient, yet AdamW would move the weights on momentum and weight decay. A mini-batch whose advantages
    are all zero (`nothing_to_learn`) is skipped when `algorithm.skip_zero_advantage_updates` is on.
    `StepResult.skipped` counts them; `skip_reason` says why a step took no optimizer step at all."""
    bounds = mini_batch_bounds(len(batch), plan.batch.updates_per_batch)
    skip = plan.spec.algorithm.skip_zero_advantage_updates
    empty = [not bool(batch.loss_mask[start:stop].any()) for start, stop in bounds]
    todo = [(start, stop) for (start, stop), none in zip(bounds, empty)
            if not none and not (skip and nothing_to_learn(plan, batch.select(start, stop)))]
    reason = None
    if not todo:
        reason = SKIP_REASONS["dropped"] if all(empty) else SKIP_REASONS["zero_advantage"]
    if todo and plan.batch.updates_per_batch > 1:
        batch.old_logprobs = backend.logprobs(batch)
    if todo and plan.needs_reference_model:
        batch.ref_logprobs = backend.logprobs(batch, reference=True)
    totals: dict[str, float] = {}
    grad_norms = []
    for start, stop in todo:
        mini = batch.select(start, stop)
        norm = LossNorm.of(mini.loss_mask, plan.batch.max_trained_tokens)
        stats = backend.forward_backward(mini, norm)
        grad_norms.append(backend.optimizer_step())
        for key, value in stats.items():  # sums over mini-batches; a peak is a peak
            totals[key] = max(totals.get(key, 0.0), value) if key in PEAK_STATS else totals.get(key, 0.0) + value
        if "gpu_used_gb" not in stats and plan.placement.device == "cuda" and torch.cuda.is_initialized():
            # a trainer in this process (the driver of a Ray backend starts no CUDA context)
            used = gpu_used_gb(plan.placement.trainer_devices[0])
            totals["gpu_used_gb"] = max(totals.get("gpu_used_gb", 0.0), used)
    return StepResult(batch, totals, grad_norms, skipped=len(bounds) - len(todo), skip_reason=reason)


def mini_batch_bounds(num_rows: int, num_updates: int) -> list[tuple[int, int]]:
    """[start, stop) of `num_updates` consecutive mini-batches over `num_rows` rows, as equal as the rows allow:
    the first `num_rows % num_updates` hold one row more (numpy's `array_split`). With fewer rows than updates the
    last ones are empty (and skipped: no loss token); the plan refuses an agent that could keep that few
    (`algorithm.updates_per_batch`)."""
    size, extra = divmod(num_rows, num_updates)
    stops = [size * (i + 1) + min(i + 1, extra) for i in range(num_updates)]
    return list(zip([0, *stops[:-1]], stops))


def nothing_to_learn(plan: RunPlan, mini: TrainBatch) -> bool:
    """True when the mini-batch's loss gradient is exactly zero: no KL term, and every sequence with loss tokens
    has advantage 0 (its groups were all-equal: every member solved, or none did)."""
    if plan.spec.algorithm.kl_coef:
        return False
    trained = mini.loss_mask.sum(-1) > 0
    return not bool(mini.advantages[trained].any())


def metrics_row(plan: RunPlan, step: int, result: StepResult, timer: PhaseTimer, sync_bytes: int,
                counters: dict[str, float] | None = None) -> dict:
    stats, batch = result.stats, result.batch
    updates = len(result.grad_norms)
    if not updates:  # every update skipped: nothing was computed (the loss and its gradient were exactly 0)
        stats = {"loss": 0.0, "tokens": 0.0, "clipped_tokens": 0.0}
    tokens = max(stats["tokens"], 1.0)
    step_time = timer["step"]
    obtained = batch.rewards[torch.isfinite(batch.rewards)]  # a dropped sample has no reward, not 0
    trained = batch.loss_mask.sum(-1)
    trained = trained[trained > 0]
    tis = batch.engine_logprobs is not None and updates
    return {
        "step": step,
        "reward/mean": float(obtained.mean()) if len(obtained) else math.nan,
        "reward/std": float(obtained.std()) if len(obtained) > 1 else 0.0,
        "loss": stats["loss"] / max(updates, 1),
        "kl": stats["kl_sum"] / tokens if plan.needs_reference_model and updates else None,
        "grad_norm": sum(result.grad_norms) / max(updates, 1),
        "clip_frac": stats["clipped_tokens"] / tokens,
        "entropy": stats["entropy_sum"] / tokens if updates else None,
        "response_len/mean": float(trained.mean()) if len(trained) else 0.0,
        **length_percentiles(trained),
        "timing_s/gen": timer.get("gen", 0.0),
        "timing_s/reward": timer.get("reward", 0.0),
        "timing_s/train": timer.get("train", 0.0),
        "timing_s/sync": timer.get("sync", 0.0),
        **({"timing_s/env": timer.get("env", 0.0)} if "env" in timer else {}),
        "timing_s/step": step_time,
        # All tokens the step processed (prompts + completions); the headline rate counts sampled tokens only.
        "perf/tokens_per_s": float(batch.attention_mask.sum()) / step_time if step_time > 0 else 0.0,
        "perf/completion_tokens_per_s": float(batch.loss_mask.sum()) / step_time if step_time > 0 else 0.0,
        "sync/bytes": sync_bytes,
        "sync/gb_per_s": sync_bytes / 1e9 / timer["sync"] if sync_bytes and timer.get("sync") else 0.0,
        "mem/peak_gb": stats.get("peak_mem_gb") or peak_memory_gb(plan.placement.device),
        "mem/gpu_used_gb": stats.get("gpu_used_gb"),
        "tis/ratio_mean": stats["is_ratio_sum"] / tokens if tis else None,
        "tis/clipped_frac": stats["is_clipped_tokens"] / tokens if tis and plan.spec.algorithm.tis_cap is not None else None,
        "train/skipped_updates": result.skipped,
        "update/skipped": int(result.skip_reason is not None),
        "update/skip_reason": result.skip_reason,
        "reward/errors": 0.0,
        "reward/dropped": 0.0,
        **(counters or {}),
    }


def length_percentiles(lengths: torch.Tensor) -> dict[str, float]:
    """`response_len/p50`, `/p90`, `/max` of a step's completion lengths (the bench reports them beside tokens/s)."""
    if not len(lengths):
        return {"response_len/p50": 0.0, "response_len/p90": 0.0, "response_len/max": 0.0}
    p50, p90 = torch.quantile(lengths.float(), torch.tensor([0.5, 0.9])).tolist()
    return {"response_len/p50": p50, "response_len/p90": p90, "response_len/max": float(lengths.max())}


def env_rollouts(plan: RunPlan, engine):
    """The environment runner when the spec names an environment (`model.kind: vla`), else None."""
    if plan.spec.rollout.env.name is None:
        return None
    from ..envs.rollout import EnvRollouts

    return EnvRollouts(plan, engine)


def replica_metrics(engine, transport) -> dict[str, float]:
    """Per rollout replica of an engine made of several (`rlspec.serve.client`): the step's generation seconds
    and samples, and the push's seconds (`timing_s/gen_replica_<i>`, `rollout/samples_replica_<i>`,
    `timing_s/sync_replica_<i>`); per Ray engine its own generation seconds (`timing_s/gen_engine_<i>`) and, with
    several, the prompts it took (`rollout/prompts_engine_<i>`); nothing for one server or an in-process engine."""
    if not hasattr(engine, "replicas"):
        return engine.metrics() if hasattr(engine, "last_dispatch") else {}
    return {**engine.metrics(), **(transport.metrics() if hasattr(transport, "metrics") else {})}


def served_version(engine, steps_done: int) -> None:
    """Tell an engine that reports its weight version (a rollout server) which trainer step it now serves."""
    if hasattr(engine, "set_weight_version"):
        engine.set_weight_version(steps_done)
