"""`gsm8k`: grade-school math in the GSM8K format, from a local JSONL or parquet file.

Each record has `question` and `answer`; the answer's final line is ``#### <number>`` (as in GSM8K),
or the record may carry the number alone. The reward extracts a number from the completion and
compares it numerically with the reference.

Extraction (`method`): ``strict`` takes the number after the last ``####`` (the format the prompt asks
for); ``flexible`` takes the last number anywhere in the completion. A completion with an extractable
but wrong answer earns `format_score`; a correct one earns `score`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..spec import SpecError
from ..spec.files import check_file, read_text
from .base import Prompt

PROMPT_TEMPLATE = "Question: {question}\nLet's think step by step and output the final answer after \"####\".\nAnswer:"
_NUMBER = r"-?[\d,]*\.?\d+"


def load_records(path: str) -> list[dict]:
    """Records of a .jsonl or .parquet file (columns `question`, `answer`)."""
    file, key = Path(path), "rollout.task.data_path"
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SpecError(key, "reading parquet needs pyarrow", "pip install 'rlspec[data]' or use .jsonl") from None
        check_file(file, key, "a local .parquet file")
        try:
            records = pq.read_table(file).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow raises its own types for corrupt files
            raise SpecError(key, f"{path} is not a readable parquet file ({type(err).__name__}: {str(err)[:200]})",
                            "give a parquet file with columns question and answer, or a .jsonl") from None
    else:
        records = []
        for lineno, line in enumerate(read_text(file, key, "a JSONL file (one JSON object per line)").splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise SpecError(f"{path}:{lineno}", f"not valid JSON ({err.msg})", "one JSON object per line") from None
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or "question" not in rec or "answer" not in rec:
            raise SpecError(f"{path}: record {i + 1}", "is not a JSON object with 'question' and 'answer'",
                            "each record needs both fields")
    if not records:
        raise SpecError("rollout.task.data_path", f"{path} holds no records", "give a file with at least one record")
    return records


def reference_answer(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer (or the whole answer when it is just a number)."""
    text = str(answer)
    if "####" in text:
        text = text.split("####")[-1]
    return text.strip().replace(",", "")


def to_prompts(records: list[dict]) -> list[Prompt]:
    return [Prompt(PROMPT_TEMPLATE.format(question=r["question"]), {"answer": reference_answer(r["answer"])})
            for r in records]


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


def reward(completion: str, prompt: Prompt, method: str = "strict", format_score: float = 0.0,
           score: float = 1.0) -> float:
    """`score` if the extracted answer equals the reference, `format_score` if one was extracted, else 0."""
    answer = extract_answer(completion, method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, prompt.meta["answer"]) else format_score
