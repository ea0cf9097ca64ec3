"""A two-turn chat agent with one tool, written with the `openai` client's chat API
(examples/agent_chat_tool.yaml; `pip install rlspec[agents]`).

Turn 1: the user message is the copy_char prompt (the letter written 16 times, "cccccccccccccccc=", in
examples/agent_chat_tool.yaml); the model answers (up to 4 tokens). The agent then
calls its one tool, `length` (how many characters the answer so far has), as the model's tool call when the
model wrote a well-formed one and on the model's behalf otherwise, and sends the result back as a
`role: tool` message. Turn 2: the model answers again. The final answer is both turns' text joined;
copy_char scores how many of its first 8 characters repeat the prompt's letter, so the model must copy in
both turns, the second after the tool result.

An async function: every agent of a step is a task on the gateway's one agent event loop, and all of them share
one HTTP client (`rlspec.agent.client.http_client`): building an OpenAI client's own HTTP client per agent costs
~20 ms of CPU each under the interpreter lock, and a thread per agent another few ms a turn (docs/agents.md).
The model's name is not asked for (`GET /models` would be one more request per trajectory): the gateway serves
the run's policy whatever the request names.
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI

from rlspec.agent.client import http_client

TOKENS_PER_TURN = 4
TOOLS = [{"type": "function", "function": {
    "name": "length", "description": "How many characters the answer so far has.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}]


def length(text: str) -> str:
    return str(len(text))


async def solve(prompt: str, base_url: str) -> str:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http_client())
    messages: list = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                 max_tokens=TOKENS_PER_TURN)
    reply = first.choices[0].message
    answer = reply.content or ""
    messages.append(reply.model_dump(exclude_none=True))  # sent back as returned: the gateway keeps its sampled ids
    call = reply.tool_calls[0] if reply.tool_calls else None
    text = json.loads(call.function.arguments).get("text", answer) if call else answer
    messages.append({"role": "tool", "tool_call_id": call.id if call else "length-0", "content": length(text)})
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                  max_tokens=TOKENS_PER_TURN)
    return answer + (second.choices[0].message.content or "")


if __name__ == "__main__":
    from rlspec.agent import command_main

    command_main(solve)
