"""Loading and calling a black-box agent: a Python function or a command.

A function agent is `fn(prompt: str, base_url: str) -> str`, called in a thread of the trainer. A command
agent is a process: it reads one JSON object ``{"prompt": ..., "base_url": ...}`` on stdin and prints
``{"answer": "..."}`` as the last non-empty line of its stdout (`command_main` does both for a function).
Either talks to the policy only through ``POST {base_url}/completions`` or ``POST {base_url}/chat/completions``.

What counts as a failed trajectory (`AgentFailure.kind`): ``error`` (the function raised, the command
exited non-zero), ``timeout`` (still running after `rollout.agent.timeout_s`: a command's process group is
killed; a function cannot be stopped from outside in Python, so its thread is abandoned and the gateway
refuses its later requests), ``invalid`` (an answer that is not a string, stdout that is not the JSON
above, and the trajectory checks of the gateway).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from typing import Callable

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


def load_agent(spec: AgentSpec) -> Callable[[str, str, float], object]:
    """`call(prompt, base_url, timeout_s) -> answer` for the agent `spec` names; `SpecError` if it cannot be found."""
    if spec.command is not None:
        if shutil.which(spec.command[0]) is None:
            raise SpecError("rollout.agent.command", f"{spec.command[0]!r} is not an executable on PATH or a path",
                            "give the program first, e.g. [python, path/to/agent.py]")
        return lambda prompt, base_url, timeout_s: _run_command(spec.command, prompt, base_url, timeout_s)
    fn = import_function(spec.function, "rollout.agent.function")
    return lambda prompt, base_url, timeout_s: fn(prompt, base_url)


def _run_command(argv: list[str], prompt: str, base_url: str, timeout_s: float) -> object:
    request = json.dumps({"prompt": prompt, "base_url": base_url})
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # its own group, so a timeout kills its children too
    except OSError as err:
        raise AgentFailure("error", f"cannot start agent command {argv[0]!r}: {err}") from None
    try:
        stdout, stderr = proc.communicate(request, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise AgentFailure("timeout", f"agent command still running after {timeout_s:g} s (rollout.agent.timeout_s); killed") from None
    if proc.returncode != 0:
        raise AgentFailure("error", f"agent command exited with code {proc.returncode}", stderr[-STDERR_TAIL_CHARS:])
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])["answer"]
    except (IndexError, json.JSONDecodeError, KeyError, TypeError):
        tail = lines[-1][:200] if lines else "(no output)"
        raise AgentFailure("invalid", f'agent command\'s last stdout line is not {{"answer": ...}} JSON: {tail!r}') from None


def command_main(fn: AgentFn) -> None:
    """Run a function agent as a command agent: request JSON on stdin, answer JSON on stdout."""
    request = json.loads(sys.stdin.read())
    answer = fn(request["prompt"], request["base_url"])
    print(json.dumps({"answer": answer}), flush=True)
