"""A synthetic multi-turn agent for measuring agentic rollouts (`tests/gpu/measure.sh agents_multiturn`,
docs/agents.md): 3 to 5 turns of 64 to 256 new tokens each, with a tool result of 20 to 100 tokens between turns.

Each turn re-sends the whole conversation, as an agent framework does, as token ids: the last turn's prompt ids, the
ids it sampled, then the tool result's ids (a random model's text need not re-tokenise to the same ids). The number
of turns, tokens and tool tokens are drawn per trajectory from its place in the step (step, prompt, sample), so a
run is repeatable. The tool result's ids are below 127 (printable ASCII in a byte vocabulary and in Qwen's).
Set `rollout.max_new_tokens` >= 256 and `rollout.max_prompt_tokens` >= the prompt plus ~1,800 tokens.
"""

from __future__ import annotations

import random

from rlspec.agent.client import completion_async

TURNS = (3, 5)
TOKENS = (64, 256)
TOOL_TOKENS = (20, 100)


def plan(place: str) -> list[tuple[int, list[int]]]:
    """The trajectory at `place` (s<step>-p<prompt>-g<sample>): each turn's max new tokens and the tool result's ids
    after it (a plain rollout of the same lengths reads them too: `tests/gpu/probe_agents.py`)."""
    rng = random.Random(place)
    turns = []
    for _ in range(rng.randint(*TURNS)):
        tokens = rng.randint(*TOKENS)
        turns.append((tokens, [rng.randrange(32, 127) for _ in range(rng.randint(*TOOL_TOKENS))]))
    return turns


async def solve(prompt: str, base_url: str) -> str:
    place = base_url.rstrip("/").split("/")[-2].rsplit("-", 1)[0]  # s<step>-p<prompt>-g<sample>
    body: dict = {"prompt": prompt}
    texts = []
    for tokens, tool in plan(place):
        choice = await completion_async(base_url, {**body, "max_tokens": tokens})
        texts.append(choice["text"])
        body = {"prompt": choice["prompt_token_ids"] + choice["token_ids"] + tool}
    return "".join(texts)
