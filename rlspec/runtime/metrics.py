"""Per-step metrics: `metrics.jsonl` (the contract), TensorBoard events, the `logging.*` loggers, a progress bar."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from .loggers import Loggers, numeric

METRIC_KEYS = (
    "step", "reward/mean", "reward/std", "loss", "kl", "grad_norm", "clip_frac", "entropy", "response_len/mean",
    "response_len/p50", "response_len/p90", "response_len/max",
    "timing_s/gen", "timing_s/reward", "timing_s/train", "timing_s/sync", "timing_s/step", "perf/tokens_per_s",
    "perf/completion_tokens_per_s", "sync/bytes", "sync/gb_per_s", "mem/peak_gb", "mem/gpu_used_gb", "reward/errors",
    "reward/dropped",
    "tis/ratio_mean", "tis/clipped_frac", "train/skipped_updates", "update/skipped", "update/skip_reason",
)
"""Keys of every row (`update/skipped` is 1 when the step took no optimizer step, `update/skip_reason` says why;
`mem/gpu_used_gb` is None without CUDA). `rollout.mode=async` adds `async/staleness_mean`, `async/pool_size`, `timing_s/wait`;
a task may add its own reward counters (the judge's `reward/judge_requests`, `reward/retries`, `reward/fallbacks`; with
`rollout.task.rewards`, each function's `reward/<name>/mean`); several
rollout servers (standalone, `hardware.num_rollout_engines` > 1) add per server i `timing_s/gen_replica_<i>`,
`rollout/samples_replica_<i>` and, in a step that pushed, `timing_s/sync_replica_<i>`; Ray engines (fsdp, deepspeed)
add per engine i `timing_s/gen_engine_<i>`, its own seconds generating (`timing_s/gen` less the slowest engine's is the
samples' transfer to the driver and the dispatch), and with several `rollout/prompts_engine_<i>`, the prompts it took
(`rollout.dispatch`)."""


class PhaseTimer(dict):
    """Seconds per phase of one step (`gen`, `train`, ...): `with timer("gen"): ...` adds to `timer["gen"]`."""

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self[name] = self.get(name, 0.0) + time.perf_counter() - start


def gpu_used_gb(device: torch.device | str) -> float:
    """Memory in use on the whole device (every process on it: a trainer's cached blocks, a colocated engine's), from
    the driver (`cudaMemGetInfo`). Read right after a train phase's last backward, while the trainer's allocator still
    caches its activations' blocks, it is that phase's peak on the device."""
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return (total - free) / 2**30


def peak_memory_gb(device: str) -> float:
    """Peak device memory of this process (CUDA allocator), or peak host RSS on CPU."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kb / 2**20


class MetricsLog:
    """Appends one JSON object per step; mirrors scalars to TensorBoard and the started `loggers`; drives the
    progress bar. metrics.jsonl is written first: a logger that fails later loses nothing there."""

    def __init__(self, out_dir: Path, total_steps: int, start_step: int = 0, progress: bool | None = None,
                 tensorboard: bool = True, loggers: Loggers | None = None) -> None:
        self.path = out_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._loggers = loggers
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        show = sys.stderr.isatty() if progress is None else progress
        self._bar = None
        if show:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, row: dict) -> None:
        missing = [k for k in METRIC_KEYS if k not in row]
        assert not missing, f"metrics row lacks {missing}"
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, row["step"])
        if self._loggers is not None:
            self._loggers.log(numeric(clean), row["step"], self.path)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(reward=f"{row['reward/mean']:.3f}", tok_s=f"{row['perf/tokens_per_s']:.0f}")

    def log_eval(self, step: int, metrics: dict) -> None:
        """A row of eval metrics alone (`eval.before_train`: step -1, before the first step's row); the loggers get
        it at step 0 (W&B drops a step below its first)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        if self._loggers is not None:
            self._loggers.log(numeric(clean), max(step, 0), self.path)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
