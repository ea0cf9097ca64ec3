"""The conformance cases: each one a spec built in code that exercises something distribution gets wrong.

Every case runs `NUM_STEPS` GRPO steps on the same fixed rollout batch (`conformance.fixture`). The
rollout batch holds 8 sequences (2 prompts x group_size 4); on 2 data-parallel ranks each rank gets 4
contiguous sequences with very different completion-token counts, so only a global token count gives
the reference's token-mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..spec import AlgorithmSpec, EnvSpec, HardwareSpec, LoraSpec, ModelSpec, RolloutSpec, Spec, SyncSpec, with_overrides
from .fixture import GROUP_SIZE, MAX_NEW_TOKENS, NUM_PROMPTS, SEED

NUM_STEPS = 3
NUM_THREADS = 1
"""torch intra-op threads per process (`hardware.num_threads`): results then do not depend on the machine's
core count, and tiny matrices run 2-5x faster on one thread than on two contended ones."""


@dataclass(frozen=True)
class Case:
    name: str
    algorithm: dict[str, Any]
    """AlgorithmSpec fields that differ from `BASE_ALGORITHM`."""
    lora_r: int = 0
    """> 0: train LoRA adapters (only on backends with `caps.supports_lora`)."""
    expect_clipping: bool = False
    """The reference must clip some tokens (ratio outside the clip range), or the case tests nothing."""
    why: str = ""
    steps: int = NUM_STEPS
    vla: bool = False
    """A vision-language-action case: the `tiny_llava` preset on the VLA fixture (only for backends with
    `vla` in `caps.model_kinds`)."""


BASE_ALGORITHM: dict[str, Any] = dict(
    group_size=GROUP_SIZE, seed=SEED, steps=NUM_STEPS, optimizer="adamw", lr=1e-2, max_grad_norm=0.0,
    loss_agg="token-mean", kl_coef=0.0, micro_batch_size=2, updates_per_batch=1, adv_norm="group_std",
)
"""Shared by every case. `max_grad_norm=0`: no clipping, so a gradient-scale bug is not masked."""

CASES: tuple[Case, ...] = (
    Case("token_mean_adamw_microbatch", dict(),
         why="token-mean over ranks with unequal token counts; 2 micro-batches per rank accumulate"),
    Case("token_mean_sgd", dict(optimizer="sgd", lr=1e-1),
         why="SGD moves weights by lr*g, so a gradient-scale bug shows in the weights (AdamW hides it)"),
    Case("seq_mean_token_mean_sgd_kl_k3", dict(optimizer="sgd", lr=1e-1, loss_agg="seq-mean-token-mean",
                                                kl_coef=0.1, kl_estimator="k3", micro_batch_size=1),
         why="the GRPO paper's aggregation; a reference model with the k3 estimator; one sequence per micro-batch"),
    Case("seq_mean_token_sum_norm_adamw_kl_k1_clip", dict(loss_agg="seq-mean-token-sum-norm", adv_norm="none",
                                                          kl_coef=0.1, kl_estimator="k1", max_grad_norm=0.05),
         why="Dr. GRPO's constant normaliser; k1 KL; gradient clipping on (the norm must be the global one)"),
    Case("multi_update_dual_clip", dict(updates_per_batch=2, micro_batch_size=1, clip_eps_low=0.02,
                                        clip_eps_high=0.02, dual_clip_c=1.05),
         expect_clipping=True,
         why="2 optimizer updates per batch: old log-probs, ratio != 1 on the second, PPO clip and dual-clip active"),
    Case("lora_adamw", dict(), lora_r=4,
         why="LoRA adapters (merged into the exported weights); only for backends that support LoRA"),
    Case("vla_token_mean_sgd", dict(optimizer="sgd", lr=1e-1), vla=True,
         why="images through the vision tower and projector, log-probs over the action tokens only, empty "
             "padding rows; only for backends that support model.kind=vla"),
)


def case_by_name(name: str) -> Case:
    for case in CASES:
        if case.name == name:
            return case
    raise KeyError(f"no conformance case named {name!r}; known: {', '.join(c.name for c in CASES)}")


def case_spec(case: Case, backend: str, num_trainer_ranks: int, sync_method: str = "auto",
              rollout_placement: str = "colocated", overrides: Sequence[str] = ()) -> Spec:
    """The full spec of `case` for `backend`: tiny_qwen2, float32, eager attention, CPU; then a backend variant's
    `overrides` (`key.path=value`, see `rlspec.spec.split_label`), which the reference never gets."""
    algorithm = AlgorithmSpec(**{**BASE_ALGORITHM, **case.algorithm, "steps": case.steps})
    lora = LoraSpec(r=case.lora_r, alpha=2 * case.lora_r or 16)
    if case.vla:
        model = ModelSpec(preset="tiny_llava", kind="vla", dtype="float32", attn_implementation="eager", lora=lora)
        rollout = RolloutSpec(engine="hf", env=EnvSpec(name="minigrid"), prompts_per_step=NUM_PROMPTS,
                              max_new_tokens=1, temperature=1.0)
    else:
        model = ModelSpec(preset="tiny_qwen2", dtype="float32", attn_implementation="eager", lora=lora)
        rollout = RolloutSpec(engine="hf", prompts_per_step=NUM_PROMPTS, max_new_tokens=MAX_NEW_TOKENS,
                              max_prompt_tokens=32, temperature=1.0)
    spec = Spec(
        algorithm=algorithm,
        model=model,
        rollout=rollout,
        sync=SyncSpec(method=sync_method),
        hardware=HardwareSpec(device="cpu", num_trainer_ranks=num_trainer_ranks, rollout=rollout_placement,
                              num_threads=NUM_THREADS),
        backend=backend,
    )
    return with_overrides(spec, overrides, "--backends") if overrides else spec
