"""A two-turn agent for the tiny byte-level model and the copy_char task (examples/agent_copy_two_turn.yaml).

Turn 1: the model continues the prompt ("c=") for up to 4 tokens. The agent then appends a tool message
(a status line it writes itself, which the model must read past) and asks the model to continue for 4
more tokens. The final answer is both completions joined; copy_char scores how many of its first 8
characters repeat the prompt's letter, so the model must copy in both turns, the second one after the
tool message. An async function: every agent of a step runs on the gateway's one agent event loop, over one
shared HTTP client. Runs as a function (`...copy_two_turn.py:solve`) or as a command (`python ...copy_two_turn.py`).
"""

from __future__ import annotations

from rlspec.agent.client import complete_async

TOKENS_PER_TURN = 4


def tool_message(first: str) -> str:
    return f"|{len(first)}>"


async def solve(prompt: str, base_url: str) -> str:
    first = await complete_async(base_url, prompt, TOKENS_PER_TURN)
    second = await complete_async(base_url, prompt + first + tool_message(first), TOKENS_PER_TURN)
    return first + second


if __name__ == "__main__":
    from rlspec.agent import command_main

    command_main(solve)
