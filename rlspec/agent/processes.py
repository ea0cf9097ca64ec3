"""Agents in processes of their own (`rollout.agent.processes` N > 0).

In one process every agent's Python (an OpenAI client's request and response models, the agent's own code), the
gateway's routes (the chat template rendered and tokenised, the reply's body) and the engine thread take turns at one
interpreter lock: on one H200 the two-turn chat example topped out near 160-250 trajectories/s at 64 agents, the
agents' side of each request costing ~2.7 ms of CPU (docs/agents.md). Here the agents and the routes run in N agent
processes, and the run's process keeps only the engine:

    run's process (`AgentProcesses`)                       agent process i (`agent_process_main`)
      jobs: (trajectory, prompt, seed) -- control pipe -->  the agent on its agent loop, its requests to the
      results: trajectory or failure   <-- control pipe --  `GatewayFront` at the process's own address
      `EngineCore` over the engine     <-- engine pipe --->  `RemoteHost` (rows, cancels, their tokens)

Each agent process is a whole gateway front (`rlspec.agent.front.GatewayFront`): the same routes, refusals and
records, its own 127.0.0.1 port for agents that use the network (a command agent, a plain function, a client of their
own), and `client.http_client`'s in-process path for those that use it. It reaches the run's engine as the HTTP
process of `rlspec serve --engine-process` reaches its engine process (`rlspec.serve.engine_process`): the rows of
every agent process join the one decode batch, and what a row samples does not depend on where its agent ran (same
seeds, same scheduler). A trajectory is assembled where its agent ran and comes back whole.

Jobs go to the agent process with the fewest running, at most `rollout.agent.concurrency` at once in all; one that
ends lets the next start. An agent process that dies fails the run naming it (its trajectories are lost with it);
the run's process ending (or its pipes closing) ends every agent process.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import wait

from ..errors import RunError
from ..serve.engine_process import (EngineCore, EnginePipe, PipeWriter, RemoteHost, _portable, _raise_portable,
                                    engine_info, received, settle_heap)
from ..spec import RunPlan
from ..tasks import Prompt
from .front import AgentJob, GatewayFront, agent_loop, finish
from .runner import AgentFailure

START_TIMEOUT_S = 300.0
"""How long the agent processes may take to start (each imports torch and the agent's modules and loads the
tokenizer: seconds, more on a loaded machine)."""
STOP_WAIT_S = 5.0


class AgentProcesses:
    """The run's side: N agent processes, an `EngineCore` per process over the run's engine host."""

    def __init__(self, plan: RunPlan, host, model_name: str) -> None:
        self.plan = plan
        self.spec = plan.spec.rollout.agent
        self.host = host
        context = multiprocessing.get_context("spawn")
        info = engine_info(host)
        self.cores: list[EngineCore] = []
        self.controls = []
        self.procs = []
        self.closed = False
        for index in range(self.spec.processes):
            control, control_child = context.Pipe()
            engine, engine_child = context.Pipe()
            proc = context.Process(target=agent_process_main, name=f"rlspec-agents-{index}", daemon=True,
                                   args=(control_child, engine_child, plan, model_name, info, sys.getswitchinterval()))
            proc.start()
            control_child.close()
            engine_child.close()
            core = EngineCore(engine, host, flush_on_iteration=False)
            threading.Thread(target=self._serve, args=(core,), name=f"rlspec-agents-{index}-engine", daemon=True).start()
            self.cores.append(core)
            self.controls.append(control)
            self.procs.append(proc)
        host.thread.on_iteration = self._flush  # each step's tokens to every agent process, one message each
        self.writers = [PipeWriter(conn, f"rlspec-agents-{i}-writer") for i, conn in enumerate(self.controls)]
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _serve(self, core: EngineCore) -> None:
        core.serve()
        core.close()  # the agent process ended or was stopped: its rows leave the batch

    def _flush(self) -> None:
        for core in self.cores:
            core.flush()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for index, (conn, proc) in enumerate(zip(self.controls, self.procs)):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise RunError(f"agent process {index} (pid {proc.pid}) did not start in {START_TIMEOUT_S:g} s")
            try:
                kind, value = conn.recv()
            except EOFError:
                proc.join(10)
                raise RunError(f"agent process {index} (pid {proc.pid}) exited with code {proc.exitcode} before it "
                               "was ready") from None
            if kind == "failed":
                raise _raise_portable(value)

    def run(self, jobs: list) -> tuple[list, RunError | None]:
        """Run every job's agent in the agent processes; fills each job's answer, failure, turns and malformed tool
        calls. Returns the assembled trajectories (None where failed) and the engine's failure while serving them."""
        by_id = {job.trajectory_id: job for job in jobs}
        kept: dict[str, object] = {}
        pending = deque(jobs)
        running = [0] * len(self.controls)
        failure: RunError | None = None
        try:
            while len(kept) < len(jobs):
                while pending and sum(running) < self.spec.concurrency:
                    target = min(range(len(running)), key=running.__getitem__)
                    job = pending.popleft()
                    self.writers[target].send(("job", job.trajectory_id, job.prompt.text, job.seed))
                    running[target] += 1
                for conn in wait(self.controls):
                    index = self.controls.index(conn)
                    try:
                        messages = received(conn.recv())
                    except (EOFError, OSError):
                        raise self._died(index) from None
                    for message in messages:
                        _, trajectory_id, trajectory, answer, failed, turns, malformed, engine_failed = message
                        job = by_id.get(trajectory_id)
                        if job is None or trajectory_id in kept:  # a cancelled step's late report
                            continue
                        running[index] -= 1
                        job.answer, job.turns, job.malformed_tool_calls = answer, turns, malformed
                        job.failure = AgentFailure(*failed) if failed is not None else None
                        kept[trajectory_id] = trajectory
                        if engine_failed is not None and failure is None:
                            failure = _raise_portable(engine_failed)
        except BaseException:  # e.g. a stop signal while the step samples: the agents are cancelled, not left running
            for writer in self.writers:
                writer.send(("cancel",))
            raise
        return [kept[job.trajectory_id] for job in jobs], failure

    def _died(self, index: int) -> RunError:
        proc = self.procs[index]
        proc.join(5)
        return RunError(f"agent process {index} (pid {proc.pid}) exited with code {proc.exitcode} while its agents "
                        "ran (rollout.agent.processes): their trajectories are lost")

    def close(self) -> None:
        """Stop every agent process (each ends at a `stop`, or when its pipes close), then make sure it has."""
        if self.closed:
            return
        self.closed = True
        for writer in self.writers:
            writer.send(("stop",))
            writer.close()
            writer.thread.join(STOP_WAIT_S)
        for proc in self.procs:
            proc.join(STOP_WAIT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.controls:
            conn.close()


# --- an agent process -----------------------------------------------------------------------------------------
def agent_process_main(control, engine, plan: RunPlan, model_name: str, info: dict, switch_interval: float) -> None:
    """An agent process: a gateway front over the run's engine (through `engine`), agents run as `control` says."""
    # A terminal's Ctrl-C reaches the run's process too, which stops this one (here it would only print a traceback).
    # A handler that does nothing, not SIG_IGN, which a command agent started from here would inherit.
    signal.signal(signal.SIGINT, _ignored)
    sys.setswitchinterval(switch_interval)
    try:
        pipe = EnginePipe(engine, info, on_exit=_engine_gone)
        host = RemoteHost.over(pipe, plan, model_name, max_queued_rows=sys.maxsize)
        front = GatewayFront(plan, host)
        loop = agent_loop()
    except BaseException as err:  # noqa: BLE001 - the run's process raises it (a SpecError stays exit 2)
        control.send(("failed", _portable(err)))
        return
    control.send(("ready", None))
    settle_heap()
    _AgentHost(control, front, loop).serve()


def _ignored(signum, frame) -> None:
    """Ctrl-C in an agent process: the run's process stops it (`agent_process_main`)."""


def _engine_gone(why: str) -> None:
    """The run's process closed the engine pipe without a stop (it died): nothing here can finish."""
    import os

    os._exit(1)


class _AgentHost:
    """An agent process's loop over its control pipe: start jobs, report them, cancel, stop."""

    def __init__(self, control, front, loop: asyncio.AbstractEventLoop) -> None:
        self.control = control
        self.front = front
        self.loop = loop
        self.writer = PipeWriter(control, "rlspec-agents-writer")
        self.running: dict[str, object] = {}

    def serve(self) -> None:
        while True:
            try:
                messages = received(self.control.recv())
            except (EOFError, OSError):  # the run's process is gone
                break
            for message in messages:
                if message[0] == "stop":
                    self._cancel_all()
                    self.writer.close()
                    self.writer.thread.join(STOP_WAIT_S)
                    return
                if message[0] == "cancel":
                    self._cancel_all()
                elif message[0] == "job":
                    _, trajectory_id, text, seed = message
                    future = self.running[trajectory_id] = asyncio.run_coroutine_threadsafe(
                        self._run(trajectory_id, text, seed), self.loop)
                    # (at once, here, if the agent has already ended)
                    future.add_done_callback(lambda _, key=trajectory_id: self.running.pop(key, None))

    def _cancel_all(self) -> None:
        for future in list(self.running.values()):
            future.cancel()

    async def _run(self, trajectory_id: str, text: str, seed: int) -> None:
        job = AgentJob(trajectory_id, Prompt(text), 0, seed=seed)
        front = self.front
        front.open(trajectory_id, seed)
        try:
            await front.run_job(job)
        finally:
            record = front.pop(trajectory_id)
        try:
            trajectory = finish(job, record)
            engine_failed, front.engine_failure = front.engine_failure, None
            failure = job.failure
            answer = job.answer if trajectory is not None else None
            self.writer.send(("done", trajectory_id, trajectory, answer,
                              (failure.kind, str(failure), failure.details) if failure is not None else None,
                              job.turns, job.malformed_tool_calls,
                              _portable(engine_failed) if engine_failed is not None else None))
        except Exception as err:  # noqa: BLE001 - reported as the trajectory's failure, never lost
            self.writer.send(("done", trajectory_id, None, None,
                              ("error", f"the agent process could not report it: {type(err).__name__}: {err}",
                               traceback.format_exc()), job.turns, job.malformed_tool_calls, None))
