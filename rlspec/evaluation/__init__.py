"""Held-out evaluation (the spec's `eval` section, `docs/evaluation.md`).

- `data`: the eval set (prompts, the reward that scores them, the answer extractor) from the spec; torch-free, so
  `rlspec plan` checks it (`check_eval_data`).
- `scores`: the metrics of one eval (mean@k, best@k, unbiased pass@k, maj@k, lengths), overall and per data source.
- `runner`: `Evaluator` samples the eval set on a rollout engine (greedy, or seeded noise of its own: it never draws
  from a training step's random stream), scores it, writes the samples to OUT/eval/step_NNNNNN.jsonl.
- `best`: `checkpoint.keep_best`, the best checkpoints by an eval metric kept beside the last ones.
- `command`: `rlspec eval SPEC --checkpoint DIR | --model DIR | --checkpoints OUT`.
"""

from .data import EvalSet, build_eval_set, check_eval_data, training_skip

__all__ = ["EvalSet", "build_eval_set", "check_eval_data", "training_skip"]
