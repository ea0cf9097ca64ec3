"""Regenerate the bring-your-own-data examples: `letters.parquet` (text prompts) and `letters_chat.jsonl` (chat
messages). Each record asks for one letter, repeated; `answer` is the letter, `repeat` how often the prompt shows it.

    python examples/data/make_letters.py
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
LETTERS = "abcd"


def main() -> None:
    text = [{"prompt": f"{letter * repeat}=", "answer": letter, "repeat": repeat}
            for repeat in (1, 2, 3) for letter in LETTERS]
    pq.write_table(pa.Table.from_pylist(text), HERE / "letters.parquet")
    with (HERE / "letters_chat.jsonl").open("w") as f:
        for repeat in (1, 2, 3):
            for letter in LETTERS:
                messages = [{"role": "system", "content": "Answer with one letter, repeated."},
                            {"role": "user", "content": f"Letter: {letter * repeat}"}]
                f.write(json.dumps({"messages": messages, "answer": letter, "repeat": repeat}) + "\n")


if __name__ == "__main__":
    main()
