"""Regenerate `gsm8k_sample.jsonl`: small GSM8K-format word problems (question + worked answer + '#### N').

    python examples/data/make_gsm8k_sample.py > examples/data/gsm8k_sample.jsonl
"""

import json
import random

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Farah", "Goran", "Hana", "Ivo", "Jun"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "stamps", "books", "shells"]


def problem(rng: random.Random) -> dict:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(4)
    a, b, c = rng.randint(2, 40), rng.randint(2, 20), rng.randint(2, 6)
    if kind == 0:
        q = f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?"
        steps, ans = f"{name} has {a} + {b} = {a + b} {item}.", a + b
    elif kind == 1:
        a = a + b
        q = f"{name} had {a} {item} and gave {b} of them to {other}. How many {item} does {name} have left?"
        steps, ans = f"{name} has {a} - {b} = {a - b} {item} left.", a - b
    elif kind == 2:
        q = f"{name} buys {c} bags with {b} {item} in each bag. How many {item} does {name} buy?"
        steps, ans = f"{name} buys {c} * {b} = {c * b} {item}.", c * b
    else:
        total = b * c
        q = f"{name} shares {total} {item} equally among {c} friends. How many {item} does each friend get?"
        steps, ans = f"Each friend gets {total} / {c} = {b} {item}.", b
    return {"question": q, "answer": f"{steps}\n#### {ans}"}


if __name__ == "__main__":
    rng = random.Random(0)
    for _ in range(64):
        print(json.dumps(problem(rng)))
