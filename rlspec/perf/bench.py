"""`rlspec bench`: the same spec on several backends, side by side.

Each backend runs the full `rlspec run` in its own process (so one backend's cached device memory and
peak-memory counter cannot leak into the next one's numbers) into OUT/<backend>/; the bench reads back
`metrics.jsonl` and reports medians over the steps after the first (`warmup_steps`), since the first
step pays for compilation, allocator growth and connection set-up.

Columns: `perf/completion_tokens_per_s` (sampled tokens per second of the whole step: the headline),
`perf/tokens_per_s` (prompt + completion tokens per step second), `perf/train_tokens_per_s` (the same tokens
per second of the train phase alone; padding is not counted, whether or not the trainer computes on it), the
step's time split, peak memory (`mem/peak_gb`: the trainer's allocator; `mem/gpu_used_gb`: the whole device at the train
phase's end, a colocated engine's holdings included), and `perf/train_mfu`, the train phase's model FLOPs utilisation:

    train FLOPs = (3 + passes_no_grad) * tokens * (2 * N + 2 * n_layers * s * d_attn)

N = parameters of the matmuls (every Linear, the LM head included, counted once when tied to the
embedding; the embedding lookup is no matmul), tokens = prompt + completion tokens of the step (padding
not counted), s = their mean length per sequence, d_attn = heads * head_dim; 2 * n_layers * s * d_attn is
causal attention's QK^T and AV per token (context s/2 on average). Every token goes through one forward
with gradient and its backward per step, whatever `updates_per_batch` (each update trains on its share of
the batch): forward + backward = 3 forwards. No-grad passes over all tokens: old log-probs when
updates_per_batch > 1, reference log-probs when kl_coef > 0. Recomputation is not counted (this is MFU,
not hardware FLOPs utilisation): neither the activations recomputed under gradient checkpointing (one more
forward of the decoder) nor the LM head recomputed chunk by chunk in backward (`rlspec.core.grpo`, one more
forward of the head). MFU = train FLOPs / (timing_s/train x the device's dense bf16 peak x trainer GPUs),
per trainer GPU: two ranks that each run at a third of the peak show 33%, not 67%; reported for 16-bit models
on a known GPU only.

Every column states its GPUs: `gpus/trainer` (the trainer ranks' GPUs), `gpus/engine` (the engines' GPUs;
colocated engines share the trainer's, so `gpus/total` does not add them twice), and the rates per GPU of the
whole run, `perf/tokens_per_s_per_gpu` and `perf/samples_per_s_per_gpu` beside `perf/samples_per_s`
(sequences per step second), so layouts of different sizes compare at a glance.

`--reference trl` adds TRL's GRPOTrainer on the same spec (`rlspec.perf.bench_trl` says what is matched).

Completion lengths (`LENGTH_COLUMNS`) stand beside the rates, since tokens/s depends on them: the mean over
the measured steps of each step's mean, the median of each step's p50 and p90, the longest of all. A backend
written `name@key=value[@key=value...]` runs with those overrides added, as its own column: one call
compares settings of one backend (`standalone,standalone@rollout.continuous_batching=false`).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import torch

from ..errors import RunError, SpecError
from ..run import build_plan
from ..runtime.metrics import read_metrics
from ..spec import split_label

REFERENCES = ("trl",)
# Dense bf16 peak of known GPUs, TFLOP/s (the vendors' datasheet numbers without sparsity).
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 70.0}

COLUMNS = ("perf/completion_tokens_per_s", "perf/tokens_per_s", "perf/train_tokens_per_s", "perf/train_mfu",
           "perf/samples_per_s", "perf/tokens_per_s_per_gpu", "perf/samples_per_s_per_gpu", "timing_s/step",
           "timing_s/gen", "timing_s/train", "timing_s/sync", "sync/bytes", "mem/peak_gb",
           "mem/gpu_used_gb")
GPU_COLUMNS = ("gpus/trainer", "gpus/engine", "gpus/total")
LENGTH_COLUMNS = ("response_len/mean", "response_len/p50", "response_len/p90", "response_len/max")


def gpu_counts(plan) -> dict[str, int]:
    """`GPU_COLUMNS` of a plan: 0 on CPU; colocated engines share the trainer ranks' GPUs."""
    placement = plan.placement
    if placement.device != "cuda":
        return dict.fromkeys(GPU_COLUMNS, 0)
    return {"gpus/trainer": len(placement.trainer_devices), "gpus/engine": len(placement.engine_devices),
            "gpus/total": placement.num_gpus}


def summarise(rows: list[dict], warmup_steps: int, flops: "TrainFlops | None" = None, plan=None) -> dict:
    """Median of each column over the steps after warm-up (all steps if the run is that short); with `plan`, its
    GPU counts and the per-GPU rates."""
    measured = rows[warmup_steps:] or rows
    gpus = gpu_counts(plan) if plan is not None else dict.fromkeys(GPU_COLUMNS, 0)
    sequences = plan.batch.sequences_per_step if plan is not None else None
    for row in measured:
        row["perf/train_mfu"] = flops.mfu(row) if flops else None
        row["perf/train_tokens_per_s"] = train_tokens_per_s(row)
        step_s = row.get("timing_s/step")
        row["perf/samples_per_s"] = sequences / step_s if sequences and step_s else None
        for rate in ("perf/tokens_per_s", "perf/samples_per_s"):
            value = row.get(rate)
            row[rate + "_per_gpu"] = value / gpus["gpus/total"] if value is not None and gpus["gpus/total"] else None
    medians = {key: _median([r.get(key) for r in measured]) for key in COLUMNS}
    return gpus | medians | _lengths(measured) | {"steps_measured": len(measured)}


def _lengths(rows: list[dict]) -> dict:
    """The run's completion lengths from its steps' (`LENGTH_COLUMNS`); None where the rows lack them."""
    mean, p50, p90, longest = ([r.get(key) for r in rows if r.get(key) is not None] for key in LENGTH_COLUMNS)
    return {"response_len/mean": statistics.fmean(mean) if mean else None, "response_len/p50": _median(p50),
            "response_len/p90": _median(p90), "response_len/max": max(longest, default=None)}


def train_tokens_per_s(row: dict) -> float | None:
    """Real (prompt + completion, no padding) tokens per second of the train phase: the tokens the step trained
    on over `timing_s/train`. None for a step that skipped its updates, as for MFU."""
    if row.get("train/skipped_updates") or not row.get("timing_s/train"):
        return None
    return row["perf/tokens_per_s"] * row["timing_s/step"] / row["timing_s/train"]


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class TrainFlops:
    """The train-phase FLOP count of the module docstring, for one plan on this machine's GPU."""

    def __init__(self, plan, peak_tflops: float, num_gpus: int = 1) -> None:
        from transformers import AutoModelForCausalLM

        from ..models.factory import preset_config

        spec = plan.spec
        if spec.model.path is None:
            config = preset_config(spec.model.preset)
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(spec.model.path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        self.matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.attn_width = config.num_hidden_layers * config.num_attention_heads * head_dim
        self.sequences = plan.batch.sequences_per_step
        self.passes = 3 + int(plan.batch.updates_per_batch > 1) + int(plan.needs_reference_model)
        self.peak = peak_tflops * 1e12 * num_gpus
        """The trainer's peak: every trainer GPU's."""

    def flops(self, tokens: float) -> float:
        mean_len = tokens / self.sequences
        return self.passes * tokens * (2 * self.matmul_params + 2 * mean_len * self.attn_width)

    def mfu(self, row: dict) -> float | None:
        """None for a step that skipped updates (`train/skipped_updates`): its FLOPs were not spent."""
        if row.get("train/skipped_updates") or not row["timing_s/train"] > 0:
            return None
        tokens = row["perf/tokens_per_s"] * row["timing_s/step"]
        return self.flops(tokens) / (row["timing_s/train"] * self.peak)


def _train_flops(plan) -> TrainFlops | None:
    """None where MFU is not defined here: no CUDA, an unknown GPU, or a 32-bit model."""
    if plan.placement.device != "cuda" or plan.spec.model.dtype == "float32" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    peak = next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)
    return TrainFlops(plan, peak, len(plan.placement.trainer_devices)) if peak else None


def bench(spec_path: str, overrides: Sequence[str], backends: Sequence[str], out: Path, warmup_steps: int = 1,
          references: Sequence[str] = ()) -> dict:
    """Run `spec_path` on each backend (all plans are compiled first, so a bad spec fails before any run)."""
    variants = {label: split_label(label) for label in backends}  # label -> (backend, extra overrides)
    plans = [build_plan(spec_path, [*overrides, *extra], name)[0] for name, extra in variants.values()]
    for ref in references:
        if ref not in REFERENCES:
            raise SpecError("--reference", f"unknown reference {ref!r}", f"use one of: {', '.join(REFERENCES)}")
        if importlib.util.find_spec(ref) is None:
            raise SpecError("--reference", f"--reference {ref} needs the {ref} package", f"pip install 'rlspec[{ref}]'")
    flops = [_train_flops(plan) for plan in plans]  # per column: a variant may change the hardware
    commands = {label: [sys.executable, "-m", "rlspec.cli", "run", spec_path, *overrides, *extra, "--backend", name,
                        "--out", str(out / _dir_name(label)), "--no-progress"]
                for label, (name, extra) in variants.items()}
    commands |= {ref: [sys.executable, "-m", f"rlspec.perf.bench_{ref}", spec_path, str(out / ref), *overrides]
                 for ref in references}
    # A reference runs the spec as given, as the first column's plan does.
    measure = dict(zip(variants, zip(plans, flops))) | {ref: (plans[0], flops[0]) for ref in references}
    results, failures = {}, {}
    for name, command in commands.items():
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            failures[name] = proc.stderr.strip().splitlines()[-20:]
            continue
        plan, flop_count = measure[name]
        results[name] = summarise(read_metrics(out / _dir_name(name) / "metrics.jsonl"), warmup_steps, flop_count, plan)
    report = {"spec": spec_path, "overrides": list(overrides), "warmup_steps": warmup_steps, "backends": results,
              "failed": failures, "device": torch.cuda.get_device_name(0) if any(flops) else None}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    if results:
        _plot(results, out / "bench.png")
    if failures:
        name, lines = next(iter(failures.items()))
        raise RunError(f"bench: backend(s) {', '.join(failures)} failed (the others are in {out}/bench.json)",
                       "\n".join(lines))
    return report


def _dir_name(label: str) -> str:
    """OUT/<dir> of a backend column: its label with `@`, `=` and `/` made file-name safe."""
    return label.replace("@", "+").replace("=", "-").replace("/", "_")


def table(report: dict) -> str:
    names = list(report["backends"])
    head = f"{'metric (median)':<30}" + "".join(f"{n:>14}" for n in names)
    lines = [head, "-" * len(head)]
    for key in GPU_COLUMNS + COLUMNS + LENGTH_COLUMNS:
        lines.append(f"{key:<30}" + "".join(_cell(report["backends"][n].get(key)) for n in names))
    if len(names) > 1:
        base = report["backends"][names[-1]]
        for key in ("perf/completion_tokens_per_s", "timing_s/step"):
            lines.append(f"{'x ' + names[-1] + ' (' + key.split('/')[1] + ')':<30}" + "".join(
                _cell(_ratio(report["backends"][n][key], base[key], key.startswith("timing"))) for n in names))
    return "\n".join(lines)


def _cell(value) -> str:
    return f"{'-':>14}" if value is None else f"{value:>14.4g}"


def _ratio(value, base, inverse: bool):
    """How many times better than the last column (faster for a time, higher for a rate)."""
    if not value or not base:
        return None
    return base / value if inverse else value / base


def _plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench extra is optional; the JSON and the table carry the numbers
        return
    names = list(results)
    fig, (split, speed) = plt.subplots(1, 2, figsize=(10, 4))
    bottom = [0.0] * len(names)
    for part in ("timing_s/gen", "timing_s/train", "timing_s/sync"):
        values = [results[n][part] for n in names]
        split.bar(names, values, bottom=bottom, label=part.split("/")[1])
        bottom = [b + v for b, v in zip(bottom, values)]
    split.set_ylabel("median seconds per step")
    split.legend()
    speed.bar(names, [results[n]["perf/completion_tokens_per_s"] for n in names])
    speed.set_ylabel("median completion tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
