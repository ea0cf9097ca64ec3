"""Loading and calling a black-box agent: a Python function or a command.

A function agent is `async def fn(prompt: str, base_url: str) -> str`, a task on the gateway's agent event loop
(hundreds run at once on one thread), or a plain `def fn(...)`, called in a thread of its own. A command agent is a
process (started and awaited on the event loop, no thread): it reads one JSON object ``{"prompt": ...,
"base_url": ...}`` on stdin and prints ``{"answer": "..."}`` as the last non-empty line of its stdout
(`command_main` does both for a function, plain or async). Each talks to the policy only through
``POST {base_url}/completions`` or ``POST {base_url}/chat/completions``.

What counts as a failed trajectory (`AgentFailure.kind`): ``error`` (the function raised, the command
exited non-zero), ``timeout`` (still running after `rollout.agent.timeout_s`: a command's process group is
killed, an async function is cancelled; a plain function cannot be stopped from outside in Python, so its thread is
abandoned; the gateway refuses the later requests of either), ``invalid`` (an answer that is not a string, stdout
that is not the JSON above, and the trajectory checks of the gateway).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from typing import Awaitable, Callable

from ..spec import AgentSpec, SpecError
from ..user_code import import_function

STDERR_TAIL_CHARS = 2000


class AgentFailure(Exception):
    """A trajectory that cannot be trained on; `kind` is error | timeout | invalid."""

    def __init__(self, kind: str, message: str, details: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.details = details


AgentFn = Callable[[str, str], object]


def load_agent(spec: AgentSpec) -> Callable[[str, str, float], Awaitable[object]]:
    """`call(prompt, base_url, timeout_s)`, a coroutine of the answer, for the agent `spec` names; `SpecError` if it
    cannot be found. Awaited on the gateway's agent event loop (`rlspec.agent.gateway`)."""
    if spec.command is not None:
        if shutil.which(spec.command[0]) is None:
            raise SpecError("rollout.agent.command", f"{spec.command[0]!r} is not an executable on PATH or a path",
                            "give the program first, e.g. [python, path/to/agent.py]")
        return lambda prompt, base_url, timeout_s: _run_command(spec.command, prompt, base_url, timeout_s)
    fn = import_function(spec.function, "rollout.agent.function")
    if inspect.iscoroutinefunction(fn):
        return lambda prompt, base_url, timeout_s: fn(prompt, base_url)
    return lambda prompt, base_url, timeout_s: _in_thread(fn, prompt, base_url)


def _in_thread(fn: AgentFn, prompt: str, base_url: str) -> "asyncio.Future":
    """A plain function agent's call in a daemon thread of its own (it may block on I/O); abandoned, not stopped, when
    the awaiting side gives up on it."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value=None, err: BaseException | None = None) -> None:
        if not future.done():
            future.set_exception(err) if err is not None else future.set_result(value)

    def call() -> None:
        try:
            answer = fn(prompt, base_url)
        except BaseException as err:  # noqa: BLE001 - the awaiting side reports it
            loop.call_soon_threadsafe(settle, None, err)
        else:
            loop.call_soon_threadsafe(settle, answer)

    threading.Thread(target=call, daemon=True, name="rlspec-agent").start()
    return future


async def _run_command(argv: list[str], prompt: str, base_url: str, timeout_s: float) -> object:
    request = json.dumps({"prompt": prompt, "base_url": base_url}).encode()
    try:  # its own session, so a timeout kills its children too
        proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE, start_new_session=True)
    except OSError as err:
        raise AgentFailure("error", f"cannot start agent command {argv[0]!r}: {err}") from None
    try:
        out, err_out = await asyncio.wait_for(proc.communicate(request), timeout_s)
    except (asyncio.TimeoutError, asyncio.CancelledError) as stopped:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
        if isinstance(stopped, asyncio.CancelledError):
            raise
        raise AgentFailure("timeout", f"agent command still running after {timeout_s:g} s (rollout.agent.timeout_s); killed") from None
    stdout, stderr = out.decode(errors="replace"), err_out.decode(errors="replace")
    if proc.returncode != 0:
        raise AgentFailure("error", f"agent command exited with code {proc.returncode}", stderr[-STDERR_TAIL_CHARS:])
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])["answer"]
    except (IndexError, json.JSONDecodeError, KeyError, TypeError):
        tail = lines[-1][:200] if lines else "(no output)"
        raise AgentFailure("invalid", f'agent command\'s last stdout line is not {{"answer": ...}} JSON: {tail!r}') from None


def command_main(fn: AgentFn) -> None:
    """Run a function agent (plain or async) as a command agent: request JSON on stdin, answer JSON on stdout."""
    request = json.loads(sys.stdin.read())
    answer = fn(request["prompt"], request["base_url"])
    if inspect.isawaitable(answer):
        answer = asyncio.run(answer)
    print(json.dumps({"answer": answer}), flush=True)
