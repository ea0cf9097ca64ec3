"""One agent trajectory -> one training sequence, from the completion calls the gateway recorded.

A call is what the engine saw and sampled: the prompt's token ids (as the engine tokenised the agent's
text), the sampled token ids and their engine log-probs. The sequence is the last call's prompt followed
by its completion; a token gets loss (mask 1) only if the engine sampled it at exactly that position.

Each call must extend the previous one: its prompt starts with the previous prompt, then repeats a prefix
(possibly empty) of the previous completion, then anything (a tool result, the agent's own text). The
repeated prefix keeps its loss and log-probs; the rest of the previous completion, which the agent cut
off (after a tool call, or the end-of-sequence token a text interface drops), is not in the sequence;
what follows is context (mask 0). Every context token is therefore the engine's own tokenisation of
what it was given. A call that does not extend the previous one (the agent rewrote its history, or the
tokeniser split the re-sent text differently before the completion starts) raises `ContextMismatch`:
the trajectory cannot be one sequence the engine actually saw, and the gateway drops it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    """One `/v1/completions` request as the engine served it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]


@dataclass
class Trajectory:
    """The assembled sequence: `prompt_ids` (the first call's prompt) then `completion_ids`, which mixes model
    tokens (mask 1, with the engine's log-prob) and context tokens (mask 0, log-prob 0)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    completion_mask: list[float]

    @property
    def num_model_tokens(self) -> int:
        return int(sum(self.completion_mask))


class ContextMismatch(ValueError):
    """A call whose prompt does not extend the previous call's prompt and (part of its) completion."""


def assemble(calls: list[Call]) -> Trajectory:
    """The training sequence of a trajectory made of `calls`, in the order the agent made them."""
    if not calls:
        raise ValueError("a trajectory needs at least one completion call")
    first = calls[0]
    sequence = list(first.prompt_ids)
    ids: list[int] = []
    logps: list[float] = []
    mask: list[float] = []
    for turn, (prev, call) in enumerate(zip(calls, calls[1:]), start=2):
        if call.prompt_ids[:len(sequence)] != sequence:
            at = next((i for i, (a, b) in enumerate(zip(call.prompt_ids, sequence)) if a != b),
                      min(len(call.prompt_ids), len(sequence)))
            raise ContextMismatch(f"call {turn}'s prompt does not start with call {turn - 1}'s prompt "
                                  f"(first difference at token {at} of {len(sequence)})")
        rest = call.prompt_ids[len(sequence):]
        kept = 0
        while kept < min(len(rest), len(prev.completion_ids)) and rest[kept] == prev.completion_ids[kept]:
            kept += 1
        ids += prev.completion_ids[:kept] + rest[kept:]
        logps += prev.logprobs[:kept] + [0.0] * (len(rest) - kept)
        mask += [1.0] * kept + [0.0] * (len(rest) - kept)
        sequence = list(call.prompt_ids)
    last = calls[-1]
    ids += last.completion_ids
    logps += last.logprobs
    mask += [1.0] * len(last.completion_ids)
    return Trajectory(list(first.prompt_ids), ids, logps, mask)
