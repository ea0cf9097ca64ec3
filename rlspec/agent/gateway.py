"""The agent gateway: an OpenAI-compatible endpoint per trajectory, in front of the run's rollout engine.

The gateway serves `rlspec.serve.app.build_app` (the app of `rlspec serve`) in a thread on 127.0.0.1,
around an `EngineHost` over the run's engine, whatever it is: the in-process `hf` engine, Ray engine
actors, or a `rlspec serve` process (then each request is forwarded to that server's `/v1/completions`,
as token ids for a chat turn). It adds one route family, ``/gateway/{trajectory}/v1/completions``,
``.../v1/chat/completions`` (and ``.../v1/models``); each agent gets
``http://127.0.0.1:PORT/gateway/{trajectory}/v1`` as its base URL, so every call is recorded against its
trajectory: the prompt token ids the engine saw, the sampled ids and the engine's log-probs.

A chat turn's prompt is the chat template's rendering of the messages, except that each assistant message
the agent sends back as it received it (the k-th assistant message against the trajectory's k-th chat
reply; content and tool calls equal) is put back as the ids the model sampled, never re-tokenised
(`rlspec.serve.chat.render`). So each turn extends the previous one with exactly the sampled tokens, unless
the template renders the earlier turns differently from how it rendered them then (e.g. a generation prompt
that earlier turns do not repeat): `trajectory.assemble` then finds the first differing token and the
trajectory is invalid, as for completions. A template that drops a sampled turn is refused (400) and the
trajectory is invalid too. `<tool_call>` text the parser could not read counts in `agent/malformed_tool_calls`.

What the gateway decides for the agent, because the loss depends on it: the temperature and top-p are the
run's (`rollout.temperature`, `rollout.top_p`: the trainer's log-probs assume them), `max_tokens` is
capped at `rollout.max_new_tokens`, the seed is derived from (algorithm.seed, step, trajectory, turn) so a
run is reproducible, and a call samples one completion of one prompt (`n` > 1 is refused); greedy decoding
and top log-probs are not offered (the run's temperature is used, and only the sampled tokens' log-probs). Requests
beyond `rollout.agent.max_turns`, or for a trajectory that timed out, are refused (429, 410).

Agents run `rollout.agent.concurrency` at a time as tasks on one agent event loop (`agent_loop`; a plain function
agent in a thread of its own), the next starting as soon as one ends, and the gateway's routes wait for the engine
without holding a thread (an agent on the agent loop using `client.http_client` reaches them in process, without
the socket: `client.serve_in_process`): their requests join one decode batch (the scheduler of `rlspec.serve`, in
front of the in-process engine here or in the rollout server), and a turn extending an earlier one prefills only its
new tokens (`rlspec.serve.prefill.PrefixCache`).

With `rollout.agent.processes` N > 0 the agents and these routes run in N agent processes instead, each a whole
`GatewayFront` at its own address over the run's engine (`rlspec.agent.processes`); the run's process keeps the engine.

A GRPO group is `group_size` trajectories of one prompt. A failed trajectory (see `runner`) is counted
and dropped, never scored; a group left with fewer than two trajectories is dropped too (GRPO compares
within a group). A step whose share of failed trajectories exceeds `rollout.agent.max_failure_rate`
fails the run with the first failure's account.
"""

from __future__ import annotations

import asyncio
import copy
import re
import secrets
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from fastapi import HTTPException, Request

from ..errors import RunError
from ..rollout.base import Rollout
from ..serve.app import EngineHost, build_app
from ..serve.openai_api import ChatRequest, CompletionRequest, Reply
from ..serve.process import SWITCH_INTERVAL_S
from ..serve.shapes import refusal_body
from ..spec import RunPlan
from ..tasks import Prompt
from .client import serve_in_process
from .runner import AgentFailure, load_agent
from .trajectory import Call, ContextMismatch, assemble

START_TIMEOUT_S = 30.0
ADMIT_WAIT_S = 0.03
"""How long an agent's turn may wait, while other rows decode, for more turns to start with it (a quarter of the rows
in flight): each admission holds the decode of every row for its host time (tens of ms for the 0.5B shape on an
H200), so a step of 64 agents x 4 turns admitted one turn at a time spends seconds there; at most 30 ms a turn."""
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


class _EngineView:
    """Lets `EngineHost` drive any `RolloutEngine`: the host asks its engine for a view with each request's
    sampling settings (`with_spec`, as `HFEngine` has); here `model` is the wrapped engine, which samples
    with `spec` when it has one (a served engine)."""

    def __init__(self, engine, tokenizer, spec, device="cpu", micro_batch_size: int = 1,
                 vocab_size: int | None = None) -> None:
        self.model, self.tokenizer, self.spec = engine, tokenizer, spec
        self.device, self.micro_batch_size = device, micro_batch_size
        self.vocab_size = vocab_size
        """The ids the model embeds (`scheduler.model_vocab`): a turn sent back as ids may hold any it sampled."""

    def with_spec(self, spec) -> "_EngineView":
        return _EngineView(self.model, self.tokenizer, spec, self.device, self.micro_batch_size, self.vocab_size)

    def generate(self, prompts: list[str] | list[list[int]], n: int, seed: int, options=None,
                 first_sample: int = 0) -> Rollout:
        if options is not None and options.plain_loop_only:
            raise ValueError("greedy decoding and top log-probs need the in-process hf engine")
        engine = self.model
        if hasattr(engine, "spec"):
            engine = copy.copy(engine)
            engine.spec = self.spec
        # Only engines that number samples take `first_sample` (the Ray engines do not): passed when asked for.
        return engine.generate(prompts, n, seed, **({"first_sample": first_sample} if first_sample else {}))


def _model_vocab(plan: RunPlan) -> int | None:
    """The token ids the plan's model embeds, read without loading it (a preset's shape, a directory's config.json:
    `spec.compile.model_config`), None if unknown."""
    from ..spec.compile import model_config

    config = model_config(plan.spec)
    vocab = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return vocab if isinstance(vocab, int) else None


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


def _weights_written() -> None:
    """Run as a scheduler job at a step's start: after a job, the pool refreshes what it derives from the weights."""


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
class _Job:
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


@dataclass
class AgentRollout:
    """The trajectories kept from one step, group after group, and what happened to the others."""

    rollout: Rollout
    """Kept trajectories; `texts` are the agents' final answers."""
    prompts: list[Prompt]
    """The prompt of each kept trajectory."""
    group_sizes: list[int]
    """Kept trajectories per group (each >= 2)."""
    metrics: dict[str, float]
    """`agent/*` counts of the step."""


def finish(job: _Job, record: _Record):
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

    async def run_job(self, job: _Job) -> None:
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


class AgentGateway:
    """Runs the agent of `plan.spec.rollout.agent` on each prompt, `group_size` times, through the engine: in this
    process (`GatewayFront`), or in `rollout.agent.processes` agent processes of their own
    (`rlspec.agent.processes`)."""

    def __init__(self, plan: RunPlan, engine) -> None:
        from ..rollout.hf import HFEngine

        self.plan = plan
        self.spec = plan.spec.rollout.agent
        hosted = engine if isinstance(engine, HFEngine) else _EngineView(engine, engine.tokenizer, plan.spec.rollout,
                                                                         vocab_size=_model_vocab(plan))
        model_name = plan.spec.model.path or plan.spec.model.preset
        # The trainer writes the weights between steps only: `rollout` says so with a job at each step's start, and
        # the pool keeps its derived copies and ended rows' K/V (prefix reuse across turns) until then.
        self.host = EngineHost(hosted, model_name, owns_weights=True)
        # Turns arrive one by one while other agents' rows decode: they start in batches (`Scheduler.admit_wait_s`).
        self.host.thread.admit_wait_s = ADMIT_WAIT_S
        self.front: GatewayFront | None = None
        self.processes = None
        if self.spec.processes:
            from .processes import AgentProcesses

            load_agent(self.spec)  # a bad function or command is named here (exit 2), before any process starts
            self.processes = AgentProcesses(plan, self.host, model_name)
        else:
            self.front = GatewayFront(plan, self.host)

    @property
    def url(self) -> str:
        return self.front.url

    @property
    def app(self):
        return self.front.app

    @property
    def openai(self):
        return self.front.openai

    async def call_in_process(self, method: str, path: str, body):
        return await self.front.call_in_process(method, path, body)

    def close(self) -> None:
        if self.front is not None:
            self.front.close()
        if self.processes is not None:
            self.processes.close()

    # --- one step's trajectories ----------------------------------------------------------------------
    def rollout(self, prompts: list[Prompt], step: int) -> AgentRollout:
        """Run `group_size` agents per prompt; assemble, count and drop as the module docstring says."""
        group_size, seed = self.plan.spec.algorithm.group_size, self.plan.spec.algorithm.seed
        jobs = [_Job(f"s{step}-p{i}-g{k}-{secrets.token_hex(4)}", prompt, i,
                     seed=(seed * 1_000_003 + step * 65_537 + (i * group_size + k) * 257) % 2**31)
                for i, prompt in enumerate(prompts) for k in range(group_size)]
        # A job: the pool refreshes what it derives from the weights (fused copies, kept prefills and prefixes) before
        # this step's first rows, as after a push (the trainer's last step wrote them in place).
        self.host.thread.run(_weights_written)
        # The engine thread makes hundreds of short torch calls an admission, each giving the interpreter lock up and
        # taking it back; with the agents' and the routes' Python (or the pipes' readers) busy on other threads, each
        # take-back can wait Python's switch interval (5 ms by default): the server's shorter one while agents run.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
        try:
            kept, failure = (self.processes or self).run(jobs)
        finally:
            sys.setswitchinterval(interval)
        if failure is not None:
            raise failure
        return self._collect(jobs, kept, step)

    def run(self, jobs: list[_Job]) -> tuple[list, RunError | None]:
        """Every job as a task on this process's agent event loop (`agent_loop`), at most `concurrency` at once: a
        job that ends starts the next one at once, whatever its group. A job past its timeout is cancelled (an async
        function, a command's wait) or abandoned (a plain function's thread); either way its trajectory is closed.
        Returns the assembled trajectories (None where failed: `finish`) and the engine's failure while serving
        them, if any."""
        front = self.front
        for job in jobs:
            front.open(job.trajectory_id, job.seed)
        slots = asyncio.Semaphore(self.spec.concurrency)  # (bound to the agent loop at its first wait)

        async def one(job: _Job) -> None:
            async with slots:
                await front.run_job(job)

        async def run_all() -> None:
            await asyncio.gather(*(one(job) for job in jobs))

        running = asyncio.run_coroutine_threadsafe(run_all(), agent_loop())
        try:
            running.result()
        except BaseException:  # e.g. a stop signal while the step samples: its agents are cancelled, not left running
            running.cancel()
            raise
        finally:
            records = [front.pop(job.trajectory_id) for job in jobs]
        failure, front.engine_failure = front.engine_failure, None
        if failure is not None:
            return [], failure
        return [finish(job, record) for job, record in zip(jobs, records)], None

    def _collect(self, jobs: list[_Job], trajectories: list, step: int) -> AgentRollout:
        failed = [job for job in jobs if job.failure is not None]
        counts = {kind: sum(job.failure.kind == kind for job in failed) for kind in ("error", "timeout", "invalid")}
        rate = len(failed) / len(jobs)
        if rate > self.spec.max_failure_rate:
            first = failed[0].failure
            raise RunError(f"step {step}: {len(failed)} of {len(jobs)} agent trajectories failed ({counts}), more than "
                           f"rollout.agent.max_failure_rate={self.spec.max_failure_rate:g}; first: {first}",
                           first.details or None)
        prompt_ids, completion_ids, logprobs, masks, texts, prompts, sizes, turns = [], [], [], [], [], [], [], []
        num_groups = max(job.group for job in jobs) + 1
        for group in range(num_groups):
            members = [(job, t) for job, t in zip(jobs, trajectories) if job.group == group and t is not None]
            if len(members) < 2:
                continue
            sizes.append(len(members))
            for job, t in members:
                prompt_ids.append(t.prompt_ids)
                completion_ids.append(t.completion_ids)
                logprobs.append(t.completion_logprobs)
                masks.append(t.completion_mask)
                texts.append(job.answer)
                prompts.append(job.prompt)
                turns.append(job.turns)
        if not sizes:
            raise RunError(f"step {step}: no group kept two valid agent trajectories ({counts} failed of {len(jobs)})")
        metrics = {"agent/trajectories": len(jobs), "agent/failed": len(failed), "agent/errors": counts["error"],
                   "agent/timeouts": counts["timeout"], "agent/invalid": counts["invalid"],
                   "agent/dropped": len(jobs) - len(texts), "agent/turns_mean": sum(turns) / len(turns),
                   "agent/malformed_tool_calls": sum(job.malformed_tool_calls for job in jobs)}
        return AgentRollout(Rollout(prompt_ids, completion_ids, logprobs, texts, masks), prompts, sizes, metrics)
