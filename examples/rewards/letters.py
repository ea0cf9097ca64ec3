"""Reward functions for the letters examples (`examples/dataset_parquet.yaml`, `examples/dataset_chat.yaml`).

A reward function names what it reads: `completion` (or `completions` for a batch), `prompt`, `completion_ids`,
and any column of the data by its name (`answer`, `repeat` here). Extra keyword arguments come from the spec.
"""


def copies(completion: str, answer: str, target_len: int = 8) -> float:
    """Fraction of the first `target_len` characters that are the letter in `answer` (an early end counts as wrong)."""
    return sum(ch == answer for ch in completion[:target_len]) / target_len


def brevity(completions: list[str], completion_ids: list[list[int]], max_tokens: int = 8) -> list[float]:
    """The batched form (a `completions` parameter, every argument a list): the share of `max_tokens` a completion
    left unused, so with `copies` at target_len 4 the best answer is four letters and the end of the turn."""
    return [1.0 - min(len(ids), max_tokens) / max_tokens for ids in completion_ids]
