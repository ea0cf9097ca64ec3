"""`copy_char`: repeat the prompt's letter. Small enough that a random-init tiny model learns it on CPU.

Prompt: ``"<c>="`` for a letter c drawn from `alphabet` (c written `repeat` times). Reward: the fraction of the first
`target_len` completion characters equal to c (an early end of sequence scores the missing characters
as wrong). A random byte-level policy scores ~1/256 per character; always emitting one letter of the
alphabet scores 1/len(alphabet); only conditioning on the prompt reaches 1.0 — so a rise past
1/len(alphabet) is the model reading its prompt, not just shifting its unigram distribution.
"""

from __future__ import annotations

import random

from .base import Prompt


def make_prompt_source(alphabet: str = "abcd", repeat: int = 1):
    """`repeat` > 1 writes the letter that many times ("ccc="): where the prompt is a small part of a long
    context (a chat template's fixed text), the letter's share of that context grows with it."""
    if not alphabet:
        raise ValueError("alphabet must not be empty")
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")

    def draw(rng: random.Random) -> Prompt:
        letter = alphabet[rng.randrange(len(alphabet))]
        return Prompt(text=f"{letter * repeat}=", meta={"letter": letter})

    return draw


def every_prompt(alphabet: str = "abcd", repeat: int = 1) -> list[Prompt]:
    """Each letter's prompt once, in alphabet order: the task's eval set (every prompt there is)."""
    return [Prompt(text=f"{letter * repeat}=", meta={"letter": letter}) for letter in alphabet]


REWARD = "rlspec.tasks.copy_char:reward"


def reward(completion: str, letter: str, target_len: int = 8) -> float:
    """Fraction of the first `target_len` characters of `completion` equal to the prompt's `letter`."""
    return sum(ch == letter for ch in completion[:target_len]) / target_len
