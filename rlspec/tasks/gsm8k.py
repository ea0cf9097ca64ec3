"""`gsm8k`: grade-school math in the GSM8K format, from local data — the `dataset` task with this module's prompt
template and reward function (`rollout.task.name: gsm8k` is `name: dataset`, `prompt_template: PROMPT_TEMPLATE`,
`reward: rlspec.tasks.gsm8k:reward`).

Each record has `question` and `answer`; the answer's final line is ``#### <number>`` (as in GSM8K),
or the record may carry the number alone. The reward extracts a number from the completion and
compares it numerically with the reference.

Extraction (`method`): ``strict`` takes the number after the last ``####`` (the format the prompt asks
for); ``flexible`` takes the last number anywhere in the completion. A completion with an extractable
but wrong answer earns `format_score`; a correct one earns `score`.
"""

from __future__ import annotations

import re
from typing import Literal

PROMPT_TEMPLATE = "Question: {question}\nLet's think step by step and output the final answer after \"####\".\nAnswer:"
REWARD = "rlspec.tasks.gsm8k:reward"
_NUMBER = r"-?[\d,]*\.?\d+"


def reference_answer(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer (or the whole answer when it is just a number)."""
    text = str(answer)
    if "####" in text:
        text = text.split("####")[-1]
    return text.strip().replace(",", "")


def extract_answer(completion: str, method: str = "strict") -> str | None:
    if method == "strict":
        found = re.findall(r"####\s*(" + _NUMBER + ")", completion)
    elif method == "flexible":
        found = re.findall(_NUMBER, completion)
    else:
        raise ValueError(f"method must be strict or flexible, got {method!r}")
    return found[-1].replace(",", "") if found else None


def _same_number(a: str, b: str, tol: float = 1e-6) -> bool:
    try:
        return abs(float(a) - float(b)) <= tol * max(1.0, abs(float(b)))
    except ValueError:
        return a.strip() == b.strip()


def reward(completion: str, answer: str, method: Literal["strict", "flexible"] = "strict", format_score: float = 0.0,
           score: float = 1.0) -> float:
    """`score` if the number extracted from `completion` equals the reference `answer` (a GSM8K answer, its number
    after ``####``), `format_score` if one was extracted, else 0."""
    found = extract_answer(completion, method)
    if found is None:
        return 0.0
    return score if _same_number(found, reference_answer(answer)) else format_score
