"""The `eval` section: held-out prompts scored with the rollout engines during a run (between steps) and by
`rlspec eval` for any checkpoint. `rlspec.evaluation` runs it; `docs/evaluation.md` explains the metrics.

Also the plain data the compiler needs to check an eval without importing the tasks: which built-in tasks have a
binary reward (pass@k needs one, or `eval.pass_threshold`) and which name an answer extractor (maj@k)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .errors import require
from .section import Section, non_negative, positive
from .sources import TaskSpec, check_function

ANSWER_EXTRACTORS = {"gsm8k": "rlspec.tasks.gsm8k:extract_answer"}
"""Built-in tasks that name an answer extractor (completion -> answer text or None): maj@k is reported for them."""
EVAL_SEED_OFFSET = 1_000_003
"""Eval samples (k > 1, not greedy) draw their noise from seed algorithm.seed + this, the same at every eval: no
training step's seed (algorithm.seed + step) is reused for steps < this."""


@dataclass
class EvalSpec(Section):
    """Held-out evaluation: scored on the rollout engines between training steps (`every_n_steps`, `before_train`,
    `at_end`) and by `rlspec eval SPEC --checkpoint DIR` (`docs/evaluation.md`). Metrics `eval/mean@k`, `eval/best@k`,
    `eval/pass@k`, `eval/maj@k`, `eval/response_len/mean`, `eval/truncated_frac` (and per data source
    `eval/<source>/...`) join the metrics row of the step they follow; samples go to OUT/eval/step_NNNNNN.jsonl."""

    every_n_steps: int = 0
    """Evaluate after the update of steps N-1, 2N-1, ... (the weights checkpoint.every_n_steps=N saves), logged in
    that step's metrics row; 0: no periodic eval."""
    before_train: bool = False
    """Evaluate the starting weights before the first step (a row of its own, `step: -1`; not on --resume)."""
    at_end: bool = False
    """Evaluate after the last step (skipped where every_n_steps already evaluated it)."""
    data_path: Optional[str] = None
    """Eval data (.jsonl, .parquet or a save_to_disk directory) read with rollout.task's column mapping; null: the
    task's own data (its `split` below, or the first `holdout_records` records); copy_char: each letter of its
    alphabet once (or this file's records, with columns prompt and letter)."""
    split: Optional[str] = None
    """The split of a saved DatasetDict to evaluate on (e.g. test); null: the data's training split."""
    holdout_records: int = 0
    """With the task's own data and split: the first N records are the eval set and training never draws them."""
    max_prompts: int = 0
    """Evaluate at most this many prompts (the first ones); 0: all of the eval data."""
    samples_per_prompt: int = 1
    """k: completions per prompt (mean@k, best@k, pass@k, maj@k)."""
    greedy: Optional[bool] = None
    """Take the argmax at each token; null: greedy when samples_per_prompt is 1, else the rollout's temperature and
    top_p."""
    reward: Optional[str] = None
    """The reward that scores eval completions: null: the training task's (rollout.task.reward / rewards); or a
    function module:function or path/to/file.py:function."""
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `reward` (only with `reward` set)."""
    pass_threshold: Optional[float] = None
    """A sample passes when its reward is >= this (pass@k); null: only a binary reward (gsm8k's with no
    format_score) gives pass@k, a sample passing when its reward is > 0."""
    pass_at: List[int] = field(default_factory=list)
    """The k values of pass@k (unbiased estimator, each <= samples_per_prompt); []: samples_per_prompt, where pass@k
    applies."""
    answer_extractor: Optional[str] = None
    """module:function taking a completion and returning its answer (text or None), for maj@k (samples_per_prompt >
    1); null: the task's own (gsm8k's), else no maj@k."""
    source_column: Optional[str] = None
    """The data's column naming each record's source (verl's data_source): metrics also per source as
    eval/<source>/...; null: overall metrics only."""

    @property
    def enabled(self) -> bool:
        """Whether a run evaluates at all (`rlspec eval` does whatever these say)."""
        return bool(self.every_n_steps) or self.before_train or self.at_end

    @property
    def is_greedy(self) -> bool:
        return self.samples_per_prompt == 1 if self.greedy is None else self.greedy

    def __post_init__(self) -> None:
        p = "eval"
        non_negative(self.every_n_steps, f"{p}.every_n_steps")
        non_negative(self.holdout_records, f"{p}.holdout_records")
        non_negative(self.max_prompts, f"{p}.max_prompts")
        positive(self.samples_per_prompt, f"{p}.samples_per_prompt")
        if self.split is not None:
            require(bool(self.split), f"{p}.split", "is empty", "name a split, e.g. test, or null")
        if self.reward is not None:
            check_function(self.reward, f"{p}.reward")
        require(self.reward is not None or not self.reward_kwargs, f"{p}.reward_kwargs",
                "are set but eval.reward is null (the training task's reward keeps its own kwargs)",
                "set eval.reward to a function, or remove eval.reward_kwargs")
        if self.answer_extractor is not None:
            check_function(self.answer_extractor, f"{p}.answer_extractor", "rlspec.tasks.gsm8k:extract_answer")
        for k in self.pass_at:
            require(isinstance(k, int) and 1 <= k <= self.samples_per_prompt, f"{p}.pass_at",
                    f"pass@{k} needs k between 1 and eval.samples_per_prompt={self.samples_per_prompt}",
                    f"raise eval.samples_per_prompt to at least {k}, or drop {k} from eval.pass_at")
        require(not (self.greedy and self.samples_per_prompt > 1), f"{p}.greedy",
                f"greedy decoding gives {self.samples_per_prompt} identical samples per prompt",
                "set eval.greedy=false (sample at the rollout's temperature), or eval.samples_per_prompt=1")
        if self.source_column is not None:
            require(bool(self.source_column), f"{p}.source_column", "is empty", "name a column, or null")


def binary_reward(task: TaskSpec) -> bool:
    """Whether the training task's reward takes only the values 0 and its full score (gsm8k without format_score)."""
    return task.name == "gsm8k" and task.reward == "task" and not task.rewards and not task.reward_kwargs.get("format_score")


def answer_extractor(spec: EvalSpec, task: TaskSpec) -> str | None:
    """The function whose answers maj@k votes on: eval.answer_extractor, else the built-in task's own."""
    return spec.answer_extractor or ANSWER_EXTRACTORS.get(task.name)


def pass_ks(spec: EvalSpec, task: TaskSpec) -> list[int]:
    """The k values of pass@k this eval reports ([] where no pass criterion is declared)."""
    declared = spec.pass_threshold is not None or (spec.reward is None and binary_reward(task))
    if not declared:
        return []
    return sorted(set(spec.pass_at)) if spec.pass_at else [spec.samples_per_prompt]


def metric_names(spec: EvalSpec, task: TaskSpec) -> list[str]:
    """The overall metrics an eval logs (each also as eval/<source>/<name> with a source column)."""
    k = spec.samples_per_prompt
    names = [f"mean@{k}", f"best@{k}", *(f"pass@{n}" for n in pass_ks(spec, task))]
    if k > 1 and answer_extractor(spec, task) is not None:
        names.append(f"maj@{k}")
    return [f"eval/{n}" for n in [*names, "response_len/mean", "truncated_frac"]]


def check_eval(spec: EvalSpec, task: TaskSpec, keep_best: Optional[str]) -> None:
    """What spans sections: pass@k asked of a reward that is not binary, a keep_best metric no eval logs."""
    if spec.pass_at and not pass_ks(spec, task):
        raise_pass = ("the reward is not declared binary (only gsm8k's own reward without format_score is), so pass@k "
                      "has no pass criterion")
        require(False, "eval.pass_at", raise_pass, "set eval.pass_threshold (a sample passes when reward >= it)")
    if keep_best is None:
        return
    require(bool(spec.every_n_steps) or spec.at_end, "checkpoint.keep_best",
            f"keeps checkpoints by {keep_best}, but no eval runs during training",
            "set eval.every_n_steps (and eval.at_end) so that checkpoints get scores, or unset checkpoint.keep_best")
    names = metric_names(spec, task)
    per_source = spec.source_column is not None and keep_best.startswith("eval/") and \
        f"eval/{keep_best.split('/', 2)[-1]}" in names
    require(keep_best in names or per_source, "checkpoint.keep_best", f"{keep_best!r} is not a metric this eval logs",
            f"use one of: {', '.join(names)}")


def check_eval_cadence(spec: EvalSpec, sync_every: int, steps: int) -> None:
    """An eval scores the engine's weights: they must be the step's, so an eval falls on a step that syncs (a run
    too short to reach its first eval is not refused for it)."""
    require(spec.every_n_steps % sync_every == 0 or spec.every_n_steps > steps, "eval.every_n_steps",
            f"{spec.every_n_steps} is not a multiple of sync.every_n_steps={sync_every}: an eval would score weights "
            "the engines have not received", f"set eval.every_n_steps to a multiple of {sync_every}")
    require(not spec.at_end or steps % sync_every == 0, "eval.at_end",
            f"the last step does not sync (algorithm.steps={steps} is not a multiple of sync.every_n_steps={sync_every})",
            "set algorithm.steps to a multiple of sync.every_n_steps, or eval.at_end=false")


def eval_due(spec: EvalSpec, step: int, steps: int) -> bool:
    """Whether an eval follows the update of `step` (0-based) in a run of `steps` steps."""
    return bool(spec.every_n_steps and (step + 1) % spec.every_n_steps == 0) or (spec.at_end and step == steps - 1)
