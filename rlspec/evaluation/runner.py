"""`Evaluator`: one eval of the eval set on a rollout engine, its metrics, and its samples on disk.

The engine samples the eval prompts greedily (`SampleOptions.greedy`), or, for k > 1 samples, with noise keyed by
the eval's own seed (`EvalSet.seed`, the same at every eval) and the sample's index (`rlspec.rollout.noise`): no
generator is shared with training, so a run's training numbers are the same with the eval on and off. On several
engines (Ray engine actors, rollout servers) the engine's own `generate` splits the prompts, each engine a share.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional

from .data import EvalSet
from .scores import Sample, summarise

TABLE_METRICS = ("mean@", "best@", "pass@", "maj@", "response_len/mean", "truncated_frac")
"""The overall metrics the end-of-run table shows, in this order (by name prefix)."""


class Evaluator:
    """Runs `eval_set` on an engine; keeps each eval's metrics (`history`) for the table at the end."""

    def __init__(self, eval_set: EvalSet, max_new_tokens: int, out_dir: Optional[Path] = None) -> None:
        self.eval_set = eval_set
        self.max_new_tokens = max_new_tokens
        self.out_dir = out_dir
        self.history: list[tuple[str, dict[str, float]]] = []

    def run(self, engine, step: int, label: Optional[str] = None) -> dict[str, float]:
        """Sample and score the eval set with `engine`'s current weights; the metrics (`eval/...`, and
        `timing_s/eval`); the samples to OUT/eval/step_NNNNNN.jsonl (`initial.jsonl` for step -1)."""
        from ..tasks import score

        s = self.eval_set
        start = time.perf_counter()
        rollout = generate(engine, [p.text for p in s.prompts], s.k, s.seed, s.greedy)
        grouped = [p for p in s.prompts for _ in range(s.k)]
        scores = score(s.scorer, rollout.texts, grouped, rollout.completion_ids)
        eos = engine.tokenizer.eos_token_id
        samples = [Sample(reward=float(r), length=len(ids), truncated=truncated(ids, eos, self.max_new_tokens),
                          answer=_answer(s.extractor, text))
                   for r, ids, text in zip(scores.rewards.tolist(), rollout.completion_ids, rollout.texts)]
        metrics = summarise(samples, s.k, s.pass_ks, s.pass_threshold, s.extractor is not None, s.sources)
        metrics["timing_s/eval"] = time.perf_counter() - start
        name = label or step_name(step)
        if self.out_dir is not None:
            self._write(self.out_dir / f"{name}.jsonl", grouped, rollout.texts, samples)
        self.history.append((name, metrics))
        return metrics

    def _write(self, path: Path, prompts, texts, samples: list[Sample]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        k = self.eval_set.k
        sources = self.eval_set.sources
        with path.open("w") as f:
            for i, (prompt, text, sample) in enumerate(zip(prompts, texts, samples)):
                row = {"prompt_index": i // k, "sample": i % k, "prompt": prompt.text, "completion": text,
                       "reward": None if math.isnan(sample.reward) else sample.reward, "length": sample.length,
                       "truncated": sample.truncated}
                if "answer" in prompt.meta:
                    row["reference"] = prompt.meta["answer"]
                if sample.answer is not None:
                    row["answer"] = sample.answer
                if sources is not None:
                    row["source"] = sources[i // k]
                f.write(json.dumps(row, default=str) + "\n")


def generate(engine, prompts: list[str], n: int, seed: int, greedy: bool):
    """`engine.generate` with `SampleOptions` (every engine passes them on to where it samples): greedy or not, and
    the engine's weights kept (`rollout.free_during_train` frees them after the step's rollout, not after an eval)."""
    from ..rollout.sampling import SampleOptions

    return engine.generate(prompts, n, seed, options=SampleOptions(greedy=greedy, keep_weights=True))


def truncated(ids: list[int], eos: int | None, max_new_tokens: int) -> bool:
    return len(ids) >= max_new_tokens and (not ids or ids[-1] != eos)


def step_name(step: int) -> str:
    return "initial" if step < 0 else f"step_{step:06d}"


def _answer(extractor, text: str) -> Optional[str]:
    if extractor is None:
        return None
    try:
        found = extractor(text)
    except Exception:  # noqa: BLE001 - an answer the user's extractor cannot find is no vote
        return None
    return None if found is None else str(found)


def table(history: list[tuple[str, dict[str, float]]]) -> str:
    """One line per eval: its label and the overall metrics (`TABLE_METRICS`)."""
    if not history:
        return ""
    keys = []
    for prefix in TABLE_METRICS:  # a sweep over eval.samples_per_prompt: mean@1 beside mean@4
        for _, metrics in history:
            keys += [k for k in metrics if k.startswith(f"eval/{prefix}") and k.count("/") == 1 + prefix.count("/")
                     and k not in keys]
    header = ["eval", *(k[len("eval/"):] for k in keys)]
    rows = [[name, *(_cell(metrics.get(k)) for k in keys)] for name, metrics in history]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def _cell(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"
