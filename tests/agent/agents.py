"""Agents that misbehave in scripted ways, for the gateway tests (imported as tests.agent.agents:NAME)."""

from __future__ import annotations

import time

from rlspec.agent.client import complete


def one_turn(prompt: str, base_url: str) -> str:
    return complete(base_url, prompt, 4)


def always_raises(prompt: str, base_url: str) -> str:
    raise RuntimeError("the agent broke")


def raises_on_b(prompt: str, base_url: str) -> str:
    """Fails on every prompt about the letter b, after a first call (its recorded call must not be used)."""
    text = complete(base_url, prompt, 4)
    if prompt.startswith("b"):
        raise RuntimeError("tool crashed on b")
    return text


def raises_in_first_of_group(prompt: str, base_url: str) -> str:
    """Fails in the first trajectory of each group (the gateway names trajectories ...-g<k>-...)."""
    if "-g0-" in base_url:
        raise RuntimeError("first of its group")
    return complete(base_url, prompt, 4)


def returns_number(prompt: str, base_url: str) -> object:
    complete(base_url, prompt, 4)
    return 42


def never_calls(prompt: str, base_url: str) -> str:
    return "aaaaaaaa"


def rewrites_history(prompt: str, base_url: str) -> str:
    """Its second prompt drops the first turn's prompt: not one sequence the engine saw."""
    first = complete(base_url, prompt, 4)
    return first + complete(base_url, "x" + first, 4)


def too_many_turns(prompt: str, base_url: str) -> str:
    text = prompt
    for _ in range(3):
        text += complete(base_url, text, 2)
    return text


def sleeps(prompt: str, base_url: str) -> str:
    time.sleep(3.0)
    return complete(base_url, prompt, 4)


# --- async agents (the gateway runs them as tasks on its one agent event loop) ---------------------------------
import asyncio  # noqa: E402
import threading  # noqa: E402

from rlspec.agent.client import complete_async  # noqa: E402

STATE: dict = {}
"""What the async agents saw (reset by the tests): the most threads alive during any agent, the trajectories
finished, cancelled agents."""


def reset() -> None:
    STATE.clear()
    STATE.update(threads=0, finished=[], cancelled=0)


async def two_turns_counting_threads(prompt: str, base_url: str) -> str:
    first = await complete_async(base_url, prompt, 2)
    STATE["threads"] = max(STATE["threads"], threading.active_count())
    second = await complete_async(base_url, prompt + first + "|", 2)
    STATE["finished"].append(base_url)
    return first + second


async def slow_tool_in_first_of_group(prompt: str, base_url: str) -> str:
    """The first trajectory of the group (…-g0-…) calls a tool that returns only once all the group's other agents
    have finished, so they must start and end while it waits: with `concurrency` 2, each of them in turn takes the
    slot of the one before."""
    first = await complete_async(base_url, prompt, 2)
    if "-g0-" in base_url:
        while len(STATE["finished"]) < 3:
            await asyncio.sleep(0.01)
    second = await complete_async(base_url, prompt + first + "|", 2)
    STATE["finished"].append(base_url)
    return first + second


async def hangs_async(prompt: str, base_url: str) -> str:
    await complete_async(base_url, prompt, 2)
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        STATE["cancelled"] += 1
        raise
    return "never"


async def cancels_its_completion_once_all_rows_decode(prompt: str, base_url: str) -> str:
    """Asks for a long completion (the gateway's client: in process, on this loop) and cancels it once every agent's
    row has started decoding (`STATE["scheduler"]`, set by the test)."""
    call = asyncio.ensure_future(complete_async(base_url, prompt, 300))
    scheduler = STATE["scheduler"]
    for _ in range(1000):
        if scheduler.stats["rows_admitted"] == STATE["rows"]:
            break
        await asyncio.sleep(0.005)
    call.cancel()
    return "cancelled"


async def asks_in_process_and_over_the_socket(prompt: str, base_url: str) -> str:
    """The same requests through the gateway's in-process client (`http_client`, `completion_async`) and through
    a plain HTTP client over its socket; the answers into STATE["pairs"]: refusals and malformed bodies, then one
    completion each way."""
    import httpx

    from rlspec.agent.client import completion_async, http_client

    unknown = base_url.replace("/gateway/", "/gateway/nobody-").rsplit("/v1", 1)[0] + "/v1"
    cases = [(base_url, {"prompt": prompt, "max_tokens": 2, "n": 2}),  # refused by the gateway (400, n)
             (base_url, {"prompt": [prompt, prompt], "max_tokens": 2}),  # refused by the route (400, prompt)
             (base_url, {"prompt": prompt, "max_tokens": "many"}),  # refused by the model (400, max_tokens)
             (unknown, {"prompt": prompt, "max_tokens": 2})]  # 404
    async with httpx.AsyncClient(trust_env=False, timeout=60) as network:
        for url, body in cases:
            here = await http_client().post(f"{url}/completions", json=body)
            there = await network.post(f"{url}/completions", json=body)
            STATE.setdefault("pairs", []).append(((here.status_code, here.json()), (there.status_code, there.json())))
        over_socket = (await network.post(f"{base_url}/completions",
                                          json={"prompt": prompt, "max_tokens": 2})).json()["choices"][0]
    in_process = await completion_async(base_url, {"prompt": prompt, "max_tokens": 2})
    STATE.setdefault("choices", []).append((in_process, over_socket))
    in_process["token_ids"].append(-7)  # the agent's own copy: what the gateway recorded is not changed
    return in_process["text"] + over_socket["text"]


async def times_out_its_completion(prompt: str, base_url: str) -> str:
    """A long completion asked in process with a short `timeout_s`: the network's read timeout, as over the socket."""
    import httpx

    from rlspec.agent.client import completion_async

    try:
        await completion_async(base_url, {"prompt": prompt, "max_tokens": 300}, timeout_s=0.05)
    except httpx.ReadTimeout:
        STATE["timeouts"] = STATE.get("timeouts", 0) + 1
    return "timed out"


def exits_its_process_on_b(prompt: str, base_url: str) -> str:
    """Ends the whole process it runs in on a prompt about b (an agent process that dies mid-step)."""
    import os

    text = complete(base_url, prompt, 4)
    if prompt.startswith("b"):
        os._exit(3)
    return text
