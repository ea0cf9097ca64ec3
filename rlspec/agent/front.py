"""The gateway's front: its routes over an engine host at an address of their own, the records of the trajectories
whose agents run beside it, and those agents' runs (`GatewayFront`). `AgentGateway` (`rlspec.agent.gateway`, where
the routes' rules are described) has one in the run's process; with `rollout.agent.processes` each agent process has
one (`rlspec.agent.processes`).
"""

from __future__ import annotations

import asyncio
import re
import secrets
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field

from fastapi import HTTPException, Request

from ..errors import RunError
from ..serve.app import build_app
from ..serve.openai_api import ChatRequest, CompletionRequest, Reply
from ..serve.shapes import refusal_body
from ..spec import RunPlan
from ..tasks import Prompt
from .client import serve_in_process
from .runner import AgentFailure, load_agent
from .trajectory import Call, ContextMismatch, assemble

START_TIMEOUT_S = 30.0
_IN_PROCESS_ROUTE = re.compile(r"/gateway/([^/]+)/v1/(completions|chat/completions)")
"""The routes `AgentGateway.call_in_process` answers: a trajectory's completions and chat completions."""

_agent_loop: asyncio.AbstractEventLoop | None = None
_agent_loop_lock = threading.Lock()


def agent_loop() -> asyncio.AbstractEventLoop:
    """The process's agent event loop, on a daemon thread of its own (started on first use): every agent of every
    gateway runs on it, so an HTTP client an agent module keeps (`rlspec.agent.client.http_client`) serves them all."""
    global _agent_loop
    with _agent_loop_lock:
        if _agent_loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="rlspec-agents").start()
            _agent_loop = loop
    return _agent_loop


def _enough_files(wanted: int) -> None:
    """Raise this process's soft limit on open files towards `wanted` (up to the hard limit): each running agent holds a
    client socket and the gateway its server side, and a common soft limit is 1,024."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard),
                                                        hard))
    except (ImportError, ValueError, OSError):  # no such limit here (Windows), or not ours to raise
        pass


def _same_message(sent: dict, reply: dict) -> bool:
    """Whether an assistant message the agent sent back is the reply it got (content and tool calls; ids aside)."""
    def calls(message: dict) -> list:
        return [((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
                for c in message.get("tool_calls") or []]

    return (sent.get("content") or "") == (reply.get("content") or "") and calls(sent) == calls(reply)


@dataclass
class _Record:
    """One trajectory's calls, filled by the route while its agent runs."""

    seed: int
    calls: list[Call] = field(default_factory=list)
    replies: list[dict | None] = field(default_factory=list)
    """Per call, the assistant message a chat call returned (None for a completions call)."""
    malformed_tool_calls: int = 0
    refused: str | None = None
    """Why the gateway refused a request of this trajectory (the trajectory is then invalid)."""
    closed: bool = False


@dataclass
class AgentJob:
    """One trajectory to run: its agent's prompt, its group, its seed; what the run gave (answer or failure, turns)."""

    trajectory_id: str
    prompt: Prompt
    group: int
    seed: int = 0
    """Its sampling seed: each turn's is derived from it (the gateway's, not the agent's)."""
    answer: object = None
    failure: AgentFailure | None = None
    started_s: float = 0.0
    turns: int = 0
    malformed_tool_calls: int = 0


def finish(job: AgentJob, record: _Record):
    """The assembled trajectory of a job, or None with `job.failure` set."""
    job.turns = len(record.calls)
    job.malformed_tool_calls = record.malformed_tool_calls
    if record.refused and (job.failure is None or job.failure.kind == "error"):
        job.failure = AgentFailure("invalid", record.refused)  # the refusal, not the agent's reaction to it
    if job.failure is not None:
        return None
    problem = None
    if not isinstance(job.answer, str):
        problem = f"the agent returned {type(job.answer).__name__}, not a str answer"
    elif not record.calls:
        problem = "the agent answered without asking the model for a completion"
    else:
        try:
            return assemble(record.calls)
        except ContextMismatch as err:
            problem = f"its turns are not one sequence the engine saw: {err}"
    job.failure = AgentFailure("invalid", problem)
    return None


class GatewayFront:
    """The gateway's routes over an engine host, at an address of their own: in the run's process over its engine
    (`AgentGateway`), or in an agent process over a pipe to it (`rlspec.agent.processes`). Holds the records of the
    trajectories whose agents run beside it, and runs those agents (`run_job`) on this process's agent loop."""

    def __init__(self, plan: RunPlan, host) -> None:
        self.plan = plan
        self.spec = plan.spec.rollout.agent
        self.agent = load_agent(self.spec)
        self.host = host
        # The bridge endpoints of the app are never used here; a token nobody knows keeps them shut.
        self.app = build_app(self.host, secrets.token_hex(16))
        self.openai = self.app.state.openai
        self._records: dict[str, _Record] = {}
        self.engine_failure: RunError | None = None
        """The engine's first failure while serving an agent (the run's failure, not the agent's)."""
        self._lock = threading.Lock()
        self._add_routes()
        self._server, self._thread, self.url = self._start()

    # --- the HTTP side -------------------------------------------------------------------------------
    def _add_routes(self) -> None:
        rollout = self.plan.spec.rollout

        def record_of(trajectory: str) -> _Record:
            with self._lock:
                record = self._records.get(trajectory)
            if record is None:
                raise HTTPException(404, detail=[{"loc": ["path", "trajectory"], "msg": f"unknown trajectory {trajectory!r}"}])
            if record.closed:
                raise HTTPException(410, detail=[{"loc": ["path", "trajectory"],
                                                  "msg": "this trajectory has ended (its agent timed out)"}])
            return record

        @self.app.get("/gateway/{trajectory}/v1/models")
        def models(trajectory: str) -> dict:
            record_of(trajectory)
            return {"object": "list", "data": [{"id": self.host.model_name, "object": "model", "owned_by": "rlspec"}]}

        async def serve(trajectory: str, req, sample) -> Reply:
            """Fix what the loss depends on (module docstring), sample, record the call."""
            record = record_of(trajectory)
            if req.n != 1:
                raise HTTPException(400, detail=[{"loc": ["body", "n"], "msg": "the gateway samples n=1 per request"}])
            turn = len(record.calls)
            if turn >= self.spec.max_turns:
                record.refused = f"more than rollout.agent.max_turns={self.spec.max_turns} model requests"
                raise HTTPException(429, detail=[{"loc": ["path", "trajectory"], "msg": record.refused}])
            wants_logprobs = bool(req.logprobs) if isinstance(req, ChatRequest) else req.logprobs is not None
            cap = min(req.max_completion_tokens or req.max_tokens or rollout.max_new_tokens, rollout.max_new_tokens) \
                if isinstance(req, ChatRequest) else min(req.max_tokens, rollout.max_new_tokens)
            forced = {"temperature": rollout.temperature, "top_p": rollout.top_p, "seed": (record.seed + turn) % 2**31,
                      "model": None, "max_tokens": cap}
            forced.update({"logprobs": True, "top_logprobs": 0, "max_completion_tokens": None}
                          if isinstance(req, ChatRequest) else {"logprobs": 0, "echo": False})
            try:
                reply = await sample(record, req.model_copy(update=forced))
            except HTTPException:
                raise
            except Exception as err:  # the engine failed: the run's failure, not the agent's (see `rollout`)
                self.engine_failure = self.engine_failure or RunError(
                    f"the rollout engine failed while serving an agent: {type(err).__name__}: {err}", traceback.format_exc())
                raise HTTPException(503, detail=[{"loc": ["engine"], "msg": "the rollout engine failed"}]) from None
            choice = reply.choices[0]
            with self._lock:
                if record.closed:  # timed out while the engine sampled: nothing of it is used
                    raise HTTPException(410, detail=[{"loc": ["path", "trajectory"], "msg": "this trajectory has ended"}])
                record.calls.append(Call(choice.prompt_ids, choice.ids, choice.logprobs))
                record.replies.append(choice.message)
                record.malformed_tool_calls += choice.malformed_tool_calls
            reply.show_logprobs = wants_logprobs
            return reply

        # Async routes: every agent's request joins the engine's decode batch while it waits, holding no worker
        # thread (a thread pool would cap the agents served at once at its size). `request` None: called in
        # process (`call_in_process`), where cancelling the caller's task cancels the rows.
        async def completion(trajectory: str, req: CompletionRequest, request: Request | None) -> Reply:
            if not isinstance(req.prompt, str) and len(req.prompt) != 1 and not all(isinstance(t, int) for t in req.prompt):
                raise HTTPException(400, detail=[{"loc": ["body", "prompt"], "msg": "send one prompt per request"}])
            return await serve(trajectory, req, lambda record, forced: self.openai.completion_async(forced, request))

        async def chat_completion(trajectory: str, req: ChatRequest, request: Request | None) -> Reply:
            async def sample(record: _Record, forced: ChatRequest) -> Reply:
                try:
                    return await self.openai.chat_async(forced, self._sampled_turns(record, forced.messages), request)
                except HTTPException as err:
                    if err.status_code == 400 and err.detail[0].get("template_dropped_turn"):
                        record.refused = err.detail[0]["msg"]  # the trajectory cannot be one sequence
                    raise

            return await serve(trajectory, req, sample)

        @self.app.post("/gateway/{trajectory}/v1/completions")
        async def completions(trajectory: str, req: CompletionRequest, request: Request):
            return (await completion(trajectory, req, request)).response()

        @self.app.post("/gateway/{trajectory}/v1/chat/completions")
        async def chat(trajectory: str, req: ChatRequest, request: Request):
            return (await chat_completion(trajectory, req, request)).response()

        self._in_process = {"completions": (CompletionRequest, completion),
                            "chat/completions": (ChatRequest, chat_completion)}

    async def call_in_process(self, method: str, path: str, body) -> tuple[int, dict | str, dict | None] | None:
        """A request of an agent of this process (`client.http_client`, `client.completion_async`) answered
        without the app's HTTP layers (routing, middleware, FastAPI's body handling: CPU under the interpreter lock
        the engine thread shares). `body`: the parsed JSON. Returns (status, the JSON body or a 500's text,
        headers), or None where the app itself must answer (another route, a stream, a body its model refuses: the
        app's 400 then names the field, as over the network). The same routes, refusals and bodies as the app's."""
        route = _IN_PROCESS_ROUTE.fullmatch(path) if method == "POST" else None
        if route is None or not isinstance(body, dict) or body.get("stream"):
            return None
        model, handler = self._in_process[route[2]]
        try:
            req = model.model_validate(body)
        except ValueError:  # pydantic's ValidationError
            return None
        try:
            reply = await handler(route[1], req, None)
        except HTTPException as err:
            return err.status_code, refusal_body(err), err.headers
        except Exception:  # noqa: BLE001 - as the app answers an error it did not expect
            return 500, "Internal Server Error", None
        return 200, reply.body(), None

    def _sampled_turns(self, record: _Record, messages: list[dict]) -> dict[int, list[int]]:
        """The message index -> sampled ids of each assistant message that is a chat reply of this trajectory as
        returned (the k-th assistant message against the k-th chat reply): rendered as the model sampled it.
        An end-of-sequence token it sampled is left to the template, which closes the turn with its own."""
        replies = [(call, reply) for call, reply in zip(record.calls, record.replies) if reply is not None]
        assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        eos = self.host.engine.tokenizer.eos_token_id
        sampled = {}
        for i, (call, reply) in zip(assistant, replies):
            if _same_message(messages[i], reply):
                ids = call.completion_ids
                sampled[i] = ids[:-1] if ids and ids[-1] == eos else list(ids)
        return sampled

    def _start(self):
        import uvicorn

        _enough_files(4 * self.spec.concurrency + 256)

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="rlspec-agent-gateway")
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RunError(f"the agent gateway did not start on 127.0.0.1:{port}")
            time.sleep(0.01)
        # an agent on this process's agent loop that uses `client.http_client` skips the network (`serve_in_process`)
        serve_in_process("127.0.0.1", port, self.app, self.call_in_process)
        return server, thread, f"http://127.0.0.1:{port}"

    def base_url(self, trajectory: str) -> str:
        return f"{self.url}/gateway/{trajectory}/v1"

    def close(self) -> None:
        serve_in_process("127.0.0.1", int(self.url.rsplit(":", 1)[1]), None)
        self._server.should_exit = True
        self._thread.join(timeout=5.0)

    # --- the agents of one step -----------------------------------------------------------------------
    def open(self, trajectory_id: str, seed: int) -> None:
        """A record for a trajectory whose agent is about to start here."""
        with self._lock:
            self._records[trajectory_id] = _Record(seed=seed)

    def pop(self, trajectory_id: str) -> _Record:
        """The trajectory's record, closed (later requests of its agent are refused) and no longer kept."""
        with self._lock:
            record = self._records.pop(trajectory_id)
            record.closed = True
        return record

    async def run_job(self, job: AgentJob) -> None:
        """Run `job`'s agent to its answer or failure (`job.answer`, `job.failure`)."""
        job.started_s = time.monotonic()
        try:  # a command kills itself at timeout_s: the margin lets it report its own timeout
            job.answer = await asyncio.wait_for(
                self.agent(job.prompt.text, self.base_url(job.trajectory_id), self.spec.timeout_s),
                self.spec.timeout_s + 1.0)
        except asyncio.TimeoutError:
            with self._lock:
                self._records[job.trajectory_id].closed = True
            job.failure = AgentFailure("timeout", f"agent still running after {self.spec.timeout_s:g} s "
                                                  "(rollout.agent.timeout_s); stopped")
        except AgentFailure as failure:
            job.failure = failure
        except (Exception, SystemExit) as err:  # noqa: BLE001 - an agent's exception is a counted, reported failure
            job.failure = AgentFailure("error", f"agent raised {type(err).__name__}: {err}", traceback.format_exc())
