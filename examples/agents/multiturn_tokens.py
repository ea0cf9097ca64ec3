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


async def solve(prompt: str, base_url: str) -> str:
    place = base_url.rstrip("/").split("/")[-2].rsplit("-", 1)[0]  # s<step>-p<prompt>-g<sample>
    rng = random.Random(place)
    body: dict = {"prompt": prompt}
    texts = []
    for turn in range(rng.randint(*TURNS)):
        choice = await completion_async(base_url, {**body, "max_tokens": rng.randint(*TOKENS)})
        texts.append(choice["text"])
        tool = [rng.randrange(32, 127) for _ in range(rng.randint(*TOOL_TOKENS))]
        body = {"prompt": choice["prompt_token_ids"] + choice["token_ids"] + tool}
    return "".join(texts)
