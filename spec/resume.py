"""Which spec fields may change on `--resume` (`rlspec.run.prepare_out_dir` applies the rule)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .schema import Spec

RESUMABLE_CHANGES = (
    "algorithm.steps",
    "checkpoint.every_n_steps", "checkpoint.keep_last", "checkpoint.save_optimizer",
    "hardware.stall_timeout_s", "hardware.stall_first_step_s", "hardware.stall_action", "hardware.preempt_grace_s",
    "hardware.num_threads",
    "hardware.ray_address", "hardware.placement_strategy",
    "backend", "hardware.num_trainer_ranks", "hardware.device", "hardware.offload_params", "hardware.offload_optimizer",
    "hardware.rollout", "sync.method",
    # how many engines sample a step: sample i's noise is keyed by (seed, i, position), whichever engine draws it
    "hardware.num_rollout_engines",
    "sync.timeout_s", "sync.verify", "sync.bucket_mb",
    "rollout.request_timeout_s", "rollout.server_start_timeout_s", "rollout.server_url",
    "rollout.server_urls",
    "rollout.task.judge.timeout_s", "rollout.task.judge.max_retries", "rollout.task.judge.backoff_s",
    "rollout.task.judge.backoff_max_s", "rollout.task.judge.jitter", "rollout.task.judge.max_concurrency",
    "rollout.agent.timeout_s", "rollout.server_reconnect_s",
    # where the agents run: their trajectories are the same in the run's process and in agent processes (tested)
    "rollout.agent.processes",
    # how a step is executed, not what it computes: the split into micro-batches (the loss normalisation is the
    # batch's, whatever the split), compiled layers, the engine's slot pool (a sample's tokens are keyed by seed,
    # sample and position, not by its slot), DeepSpeed's ZeRO stage and buckets, FSDP2's resharding
    "algorithm.micro_batch_size", "algorithm.micro_batch_tokens", "model.compile_layers",
    "rollout.continuous_batching", "rollout.decode_slots", "rollout.dispatch", "rollout.dispatch_chunk_prompts",
    "hardware.deepspeed.zero_stage", "hardware.deepspeed.overlap_comm", "hardware.deepspeed.contiguous_gradients",
    "hardware.deepspeed.reduce_bucket_numel", "hardware.deepspeed.prefetch_bucket_numel",
    "hardware.deepspeed.param_persistence_numel", "hardware.deepspeed.max_live_numel",
    "hardware.deepspeed.module_granularity_numel", "hardware.deepspeed.memory_efficient_linear",
    "hardware.fsdp.reshard_after_forward", "hardware.fsdp.gather_during_rollout",
    # where the metrics go
    "logging.tensorboard", "logging.wandb.enabled", "logging.wandb.project", "logging.wandb.entity",
    "logging.wandb.run_name", "logging.wandb.mode", "logging.wandb.tags", "logging.mlflow.enabled",
    "logging.mlflow.tracking_uri", "logging.mlflow.experiment", "logging.mlflow.run_name",
    # what is evaluated and kept by score (eval.holdout_records is not here: it takes records out of training)
    "eval.every_n_steps", "eval.before_train", "eval.at_end", "eval.data_path", "eval.split", "eval.max_prompts",
    "eval.samples_per_prompt", "eval.greedy", "eval.reward", "eval.reward_kwargs", "eval.pass_threshold",
    "eval.pass_at", "eval.answer_extractor", "eval.source_column",
    "checkpoint.keep_best", "checkpoint.keep_best_n", "checkpoint.keep_best_mode",
)
"""Spec fields that may change on `--resume`: how long to run, when to save, how long to wait, which cluster to
join, and where the trainer runs (backend, rank count, device, offload: a checkpoint holds the HF model and the
optimizer state by parameter name, which every backend at any rank count resumes; LoRA excepted, see
`rlspec.run.prepare_out_dir`), none of which changes the math of a step — with one exception, which the run
warns of (`rlspec.runtime.checkpoints.resume_warnings`, in run.log and plan.json): below fp32 weights, a trainer
that keeps no fp32 master weights (standalone) resuming a checkpoint that has them steps the lower-precision
weights from there on. Every other field (the model, the
algorithm's constants, the group size, the seed, sampling, the task, the number of rollout engines) must be
what the run started with: `resume_changes` names the first that is not."""


def resume_changes(started: dict, now: dict) -> tuple[list[str], list[str]]:
    """(allowed, refused): the dotted keys whose values differ between two `Spec` dicts (`RunPlan.to_dict()["spec"]`),
    split by `RESUMABLE_CHANGES`. A field the started run's rlspec did not have yet counts as its default."""
    old, new = flatten(started), flatten(now)
    if "rollout.task.shuffle" not in old and old.get("rollout.task.shuffle_seed", 0) is None:
        old["rollout.task.shuffle"] = False  # before `shuffle` existed, a null shuffle_seed kept the file's order
    defaults = flatten(dataclasses.asdict(Spec()))
    changed = [key for key in sorted(old.keys() | new.keys())
               if old.get(key, defaults.get(key, _ABSENT)) != new.get(key, _ABSENT)]
    allowed = [key for key in changed if key in RESUMABLE_CHANGES]
    return allowed, [key for key in changed if key not in RESUMABLE_CHANGES]


_ABSENT = object()


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested spec dict as {dotted key: value}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
