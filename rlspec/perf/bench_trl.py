"""The bench's reference row from outside rlspec: TRL's `GRPOTrainer` (transformers `generate`) on the spec.

Run as its own process by `rlspec bench --reference trl` (`python -m rlspec.perf.bench_trl SPEC OUT [overrides]`);
it writes `OUT/metrics.jsonl` with the bench's columns, one row per optimizer step.

Matched with the rlspec run of the same spec: the model (same preset or path, dtype, attention kernel, seed,
`model.eos_hazard`, so the same initial weights and completion-length distribution), tokenizer, task prompts
(the same prompts in the same order) and reward, group size, prompts per step, max new tokens, temperature,
top-p, optimizer (AdamW, lr, betas, eps, weight decay, grad clip), KL coefficient, clip range, updates per
batch, loss aggregation and advantage normalisation, micro-batch size (TRL's `per_device_train_batch_size`, with gradient accumulation over the
step's batch, so one generation per optimizer step), gradient checkpointing.
Not matched: TRL generates with `model.generate` (dynamic KV cache, its own sampling loop) and samples
different tokens (other RNG); its learning-rate schedule is set to constant like rlspec's; it computes
no old log-probs when there is one update per batch (as rlspec); `timing_s/train` here is the step
minus generation (TRL's scoring, padding and logging included); TRL has no weight sync (its policy is
its generator), so `timing_s/sync` is 0.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from ..core.step import length_percentiles
from ..models.base import checkpoint_activations
from ..models.factory import load_model, load_tokenizer
from ..run import build_plan
from ..runtime.metrics import peak_memory_gb

LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


def run_trl(spec_path: str, out: Path, overrides: list[str]) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    plan, task = build_plan(spec_path, overrides)
    spec = plan.spec
    algo, rollout = spec.algorithm, spec.rollout
    sequences = plan.batch.prompts_per_step * algo.group_size
    prompts = [p for step in range(algo.steps) for p in task.sample(step, plan.batch.prompts_per_step)]
    dataset = Dataset.from_list([{"prompt": p.text, "prompt_index": i} for i, p in enumerate(prompts)])

    def reward(completions, prompt_index, **_):
        return [task.reward(text, prompts[i]) for text, i in zip(completions, prompt_index)]

    tokenizer = load_tokenizer(spec.model)
    model = load_model(spec.model, algo.seed)
    if spec.model.gradient_checkpointing:
        checkpoint_activations(model)
    config = GRPOConfig(
        output_dir=str(out / "trl_output"), max_steps=algo.steps, logging_steps=1, report_to="none",
        save_strategy="no", seed=algo.seed, shuffle_dataset=False, remove_unused_columns=False,
        per_device_train_batch_size=algo.micro_batch_size,
        gradient_accumulation_steps=max(1, sequences // algo.micro_batch_size),
        num_generations=algo.group_size, max_completion_length=rollout.max_new_tokens,
        temperature=rollout.temperature, top_p=rollout.top_p, top_k=0, use_vllm=False,
        learning_rate=algo.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=algo.adam_beta1,
        adam_beta2=algo.adam_beta2, adam_epsilon=algo.adam_eps, weight_decay=algo.weight_decay,
        max_grad_norm=algo.max_grad_norm, optim="adamw_torch",
        beta=algo.kl_coef, epsilon=algo.clip_eps_low, epsilon_high=algo.clip_eps_high,
        num_iterations=algo.updates_per_batch, loss_type=LOSS_TYPES[algo.loss_agg],
        scale_rewards="group" if algo.adv_norm == "group_std" else "none",
        bf16=spec.model.dtype == "bfloat16", fp16=spec.model.dtype == "float16",
        gradient_checkpointing=spec.model.gradient_checkpointing, log_completions=False,
    )
    timing = _GenerateTimer(model, tokenizer.eos_token_id)
    rows: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            _sync()
            timing.reset()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            step_s = time.perf_counter() - self.start
            rows.append({
                "step": len(rows), "timing_s/step": step_s, "timing_s/gen": timing.seconds,
                "timing_s/train": step_s - timing.seconds, "timing_s/sync": 0.0, "sync/bytes": 0,
                "perf/tokens_per_s": (timing.prompt_tokens + timing.completion_tokens) / step_s,
                "perf/completion_tokens_per_s": timing.completion_tokens / step_s,
                "mem/peak_gb": peak_memory_gb(plan.placement.device),
                "response_len/mean": float(torch.tensor(timing.lengths, dtype=torch.float).mean()) if timing.lengths else 0.0,
                **length_percentiles(torch.tensor(timing.lengths)),
            })

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    out.mkdir(parents=True, exist_ok=True)
    with (out / "metrics.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _GenerateTimer:
    """Wraps `model.generate` (what TRL's HF-generate mode calls): seconds and tokens per optimizer step."""

    def __init__(self, model: torch.nn.Module, eos: int) -> None:
        self.eos = eos
        self.reset()
        inner = model.generate

        def generate(*args, **kwargs):
            _sync()
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            _sync()
            self.seconds += time.perf_counter() - start
            prompt = kwargs["input_ids"]
            self.prompt_tokens += int(kwargs["attention_mask"].sum())
            completion = out[:, prompt.shape[1]:]
            ended = (completion == self.eos).int()
            # tokens up to and including the first end token (TRL's completion mask)
            lengths = ((ended.cumsum(-1) - ended) == 0).sum(-1)
            self.completion_tokens += int(lengths.sum())
            self.lengths += lengths.tolist()
            return out

        model.generate = generate

    def reset(self) -> None:
        self.seconds, self.prompt_tokens, self.completion_tokens = 0.0, 0, 0
        self.lengths: list[int] = []


if __name__ == "__main__":
    run_trl(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
