"""A GSM8K agent with a calculator tool (examples/gsm8k_calc_agent.yaml).

The agent tells the model it may write ``<calc>EXPRESSION</calc>``. After each completion it looks for the
first such call: if there is one, it keeps the completion up to the closing tag, appends `` = RESULT``
(evaluated by `rlspec.agent.calculator`, which accepts arithmetic only and never executes model text;
an error message takes the result's place) and asks the model to continue. A completion without a
call ends the episode. The final answer is everything after the question (the model's reasoning, the tool results
and its "#### N" line), which the gsm8k reward scores. An async function: the calculator is pure arithmetic, quick
enough to run on the agents' event loop; a slow or blocking tool would go through `await asyncio.to_thread(...)`.
"""

from __future__ import annotations

import re

from rlspec.agent.calculator import CalculatorError, evaluate, format_number
from rlspec.agent.client import complete_async

INSTRUCTIONS = "You have a calculator: write <calc>expression</calc> and the result follows it.\n"
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_TOOL_CALLS = 4
TOKENS_PER_TURN = 256


def calculator(expression: str) -> str:
    try:
        return format_number(evaluate(expression))
    except CalculatorError as err:
        return f"error: {err}"


async def solve(prompt: str, base_url: str) -> str:
    start = INSTRUCTIONS + prompt
    text = start
    for _ in range(MAX_TOOL_CALLS):
        completion = await complete_async(base_url, text, TOKENS_PER_TURN)
        call = CALL.search(completion)
        if call is None:
            return text[len(start):] + completion
        text += completion[:call.end()] + f" = {calculator(call.group(1))}\n"
    return text[len(start):] + await complete_async(base_url, text, TOKENS_PER_TURN)


if __name__ == "__main__":
    from rlspec.agent import command_main

    command_main(solve)
