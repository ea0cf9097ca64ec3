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
new tokens (`rlspec.serve.kv.prefix.PrefixCache`).

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
import secrets
import sys
from dataclasses import dataclass

from ..errors import RunError
from ..rollout.base import Rollout
from ..serve.app import EngineHost
from ..serve.process import SWITCH_INTERVAL_S
from ..spec import RunPlan
from ..tasks import Prompt
from .front import AgentJob, GatewayFront, agent_loop, finish
from .runner import load_agent

ADMIT_WAIT_S = 0.03
"""How long an agent's turn may wait, while other rows decode, for more turns to start with it (a quarter of the rows
in flight): each admission holds the decode of every row for its host time (tens of ms for the 0.5B shape on an
H200), so a step of 64 agents x 4 turns admitted one turn at a time spends seconds there; at most 30 ms a turn."""

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


def _weights_written() -> None:
    """Run as a scheduler job at a step's start: after a job, the pool refreshes what it derives from the weights."""


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
        jobs = [AgentJob(f"s{step}-p{i}-g{k}-{secrets.token_hex(4)}", prompt, i,
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
            if self.processes is not None:
                kept, failure = self.processes.run(jobs)
            else:
                kept, failure = self.run(jobs)
        finally:
            sys.setswitchinterval(interval)
        if failure is not None:
            raise failure
        return self._collect(jobs, kept, step)

    def run(self, jobs: list[AgentJob]) -> tuple[list, RunError | None]:
        """Every job as a task on this process's agent event loop (`agent_loop`), at most `concurrency` at once: a
        job that ends starts the next one at once, whatever its group. A job past its timeout is cancelled (an async
        function, a command's wait) or abandoned (a plain function's thread); either way its trajectory is closed.
        Returns the assembled trajectories (None where failed: `finish`) and the engine's failure while serving
        them, if any."""
        front = self.front
        for job in jobs:
            front.open(job.trajectory_id, job.seed)
        slots = asyncio.Semaphore(self.spec.concurrency)  # (bound to the agent loop at its first wait)

        async def one(job: AgentJob) -> None:
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

    def _collect(self, jobs: list[AgentJob], trajectories: list, step: int) -> AgentRollout:
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
