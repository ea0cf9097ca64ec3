"""Where an agent step's time goes: one gateway over the spec's in-process engine, `--steps` rollouts of `--agents`
trajectories (the spec's agent, all at once), no training. Per step (the first one warms up: pool, graphs) one JSON
line: the step's wall, the engine thread's seconds admitting (prefill) and decoding (the scheduler's counters), the
seconds calls spent waiting for the engine (queue + admission + decode, summed over calls and divided by the
agents, i.e. per agent) against each agent's wall, the turns, the model tokens, and the prefix cache's counters.
`--http`: the agents reach the gateway over its socket (else in process, as an agent on the process's agent loop
does). With `rollout.agent.processes=N` the agents run in N processes of their own (`cpu_s_agent_procs`: their CPU
seconds; the calls' wait is not measured there). Per step also the CPU seconds of the engine thread, the agents' loop, the HTTP server's thread and the rest.
`--plain-tokens N` then times the engine's plain batched rollout of as many trajectories, N new tokens each;
`--plain-like-multiturn` also times a plain rollout of each trajectory's own length (`plain_pool_step` lines): the
multiturn agent's (`examples/agents/multiturn_tokens.py`) model tokens of that trajectory, summed over its turns, as
one row each in the serving pool its turns decode in, all rows at once, no turns and no tool results.
    python tests/gpu/probe_agents.py SPEC [override ...] [--agents 64] [--steps 4] [--plain-tokens N]
        [--plain-like-multiturn] [--http]
e.g. python tests/gpu/probe_agents.py examples/agent_chat_tool.yaml --agents 64 (docs/agents.md)."""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--agents", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=0, help="agents at once (default: all of a step's)")
    parser.add_argument("--plain-tokens", type=int, default=0,
                        help="then time the engine's plain batched rollout of the same prompts, this many new tokens")
    parser.add_argument("--plain-steps", type=int, default=3, help="plain rollouts timed (after a warm-up one)")
    parser.add_argument("--plain-like-multiturn", action="store_true",
                        help="also a plain rollout of each trajectory's own length as the multiturn agent plans it")
    parser.add_argument("--http", action="store_true",
                        help="agents reach the gateway over its socket, not in process (`client.serve_in_process`)")
    parser.add_argument("--admit-wait-s", type=float, default=None,
                        help="the scheduler's admit_wait_s (default: the gateway's, agent.gateway.ADMIT_WAIT_S)")
    parser.add_argument("--fixed-admit-wait", action="store_true",
                        help="the admission wait as before it followed the admissions' cost: admit_wait_s always")
    args = parser.parse_args()

    from rlspec.agent.gateway import AgentGateway
    from rlspec.run import build_plan
    from rlspec.serve.process import build_engine

    probe, _ = build_plan(args.spec, args.overrides)
    group = probe.spec.algorithm.group_size
    prompts = max(1, args.agents // group)
    plan, task = build_plan(args.spec, [*args.overrides, f"rollout.prompts_per_step={prompts}",
                                        f"rollout.agent.concurrency={args.concurrency or prompts * group}",
                                        f"algorithm.micro_batch_size={prompts * group}"])
    if plan.spec.hardware.num_threads:  # as `rlspec run` does
        import torch

        torch.set_num_threads(plan.spec.hardware.num_threads)
    engine = build_engine(plan)
    gateway = AgentGateway(plan, engine)
    if args.http:
        from rlspec.agent.client import serve_in_process

        serve_in_process("127.0.0.1", int(gateway.url.rsplit(":", 1)[1]), None)
    waited = [0.0]
    for name in ("completion_async", "chat_async") if gateway.front else ():  # the seconds each call awaited the
        original = getattr(gateway.openai, name)

        async def timed(*a, _original=original, **k):
            began = time.perf_counter()
            try:
                return await _original(*a, **k)
            finally:
                waited[0] += time.perf_counter() - began

        setattr(gateway.openai, name, timed)
    scheduler = gateway.host.thread
    if args.admit_wait_s is not None:
        scheduler.admit_wait_s = args.admit_wait_s
    if args.fixed_admit_wait:  # the average never moves from its first admission's (graphs captured: >= the wait)
        import rlspec.serve.scheduler as scheduler_module

        scheduler_module.ADMIT_COST_WEIGHT, scheduler.admit_cost_s = 0.0, 1.0
    procs = gateway.processes.procs if gateway.processes else []
    try:
        for step in range(args.steps):
            before, waited[0] = dict(scheduler.stats), 0.0
            prefix_before = _prefix(scheduler)
            captured_before = _captured(scheduler)
            cpu_before = {**_thread_cpu(), "agent_procs": _procs_cpu(procs)}
            began = time.perf_counter()
            out = gateway.rollout(task.sample(step, prompts), step)
            wall = time.perf_counter() - began
            stats = {k: scheduler.stats[k] - before[k] for k in ("admits", "admit_s", "steps", "decode_s")}
            cpu = {name: round(s - cpu_before.get(name, 0.0), 3)
                   for name, s in {**_thread_cpu(), "agent_procs": _procs_cpu(procs)}.items()}
            model_tokens = sum(sum(m) for m in out.rollout.completion_mask)
            n = out.metrics["agent/trajectories"]
            print(json.dumps({
                "step": step, "agents": n, "failed": out.metrics["agent/failed"], "wall_s": round(wall, 4),
                "trajectories_per_s": round(n / wall, 1), "model_tokens_per_s": round(model_tokens / wall, 1),
                "turns_mean": out.metrics["agent/turns_mean"], "model_tokens_mean": round(model_tokens / max(n, 1), 1),
                "engine_admit_s": round(stats["admit_s"], 4), "engine_decode_s": round(stats["decode_s"], 4),
                "engine_busy_share": round((stats["admit_s"] + stats["decode_s"]) / wall, 3),
                "admits": stats["admits"], "decode_runs": stats["steps"],
                "admit_ms_each": round(1000 * stats["admit_s"] / max(stats["admits"], 1), 2),
                **{f"cpu_s_{name}": v for name, v in cpu.items()},
                "call_wait_s_per_agent": round(waited[0] / max(n, 1), 4),
                "call_wait_share": round(waited[0] / max(n, 1) / wall, 3),
                **{k: round(v - captured_before[k], 4) for k, v in _captured(scheduler).items()},
                **{f"prefix_{k}": v - prefix_before.get(k, 0) for k, v in _prefix(scheduler).items()}}), flush=True)
        if args.plain_tokens:
            plain(engine, task, prompts, group, args.plain_tokens, args.plain_steps)
        if args.plain_like_multiturn:
            plain_like_multiturn(engine, task, prompts, group, args.plain_steps)
    finally:
        gateway.close()


def plain(engine, task, prompts: int, group: int, tokens: int, steps: int) -> None:
    """The in-process engine's batched generate of the same number of prompts x group, `tokens` new tokens each (as a
    plain `rlspec run` step samples), `steps` times after a warm-up call: generated tokens/s. (`--steps 0`: alone in
    its process, the gateway's pool never made.)"""
    import dataclasses

    import torch

    sampler = engine.with_spec(dataclasses.replace(engine.spec, max_new_tokens=tokens))
    for step in range(1 + steps):
        texts = [p.text for p in task.sample(step, prompts)]
        began = time.perf_counter()
        out = sampler.generate(texts, group, seed=step)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - began
        generated = sum(len(ids) for ids in out.completion_ids)
        print(json.dumps({"plain_step": step, "rows": len(out.completion_ids), "wall_s": round(wall, 4),
                          "tokens_mean": round(generated / len(out.completion_ids), 1),
                          "trajectories_per_s": round(len(out.completion_ids) / wall, 1),
                          "model_tokens_per_s": round(generated / wall, 1)}), flush=True)


def plain_like_multiturn(engine, task, prompts: int, group: int, steps: int) -> None:
    """Each trajectory of a step as one row of its own length: the multiturn agent's model tokens for it (the sum of
    its turns' max tokens, `multiturn_tokens.plan`; a random-init model writes them all), its prompt the task's, in
    the serving pool the agents' turns decode in (`make_pool`), every row admitted as slots free; `steps` times after
    a warm-up: generated tokens/s against the agents' for the same trajectories, without their turns."""
    from pathlib import Path

    import torch

    from rlspec.serve.pool import RowSampling
    from rlspec.serve.scheduler import make_pool
    from rlspec.user_code import import_function

    path = Path(__file__).resolve().parents[2] / "examples" / "agents" / "multiturn_tokens.py"
    plan = import_function(f"{path}:plan", "--plain-like-multiturn")
    pool = make_pool(engine)
    for step in range(1 + steps):
        rows = [(i * group + k, engine.tokenizer(p.text, add_special_tokens=False).input_ids,
                 RowSampling(key=step * 100_003 + i * group + k,
                             max_tokens=sum(tokens for tokens, _ in plan(f"s{step}-p{i}-g{k}"))))
                for i, p in enumerate(task.sample(step, prompts)) for k in range(group)]
        assert all(pool.fits(len(ids), sampling.max_tokens) for _, ids, sampling in rows), \
            "a trajectory's tokens pass the pool's rows: raise rollout.max_prompt_tokens"
        planned, generated = sum(r[2].max_tokens for r in rows), 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        began = time.perf_counter()
        waiting = list(rows)
        while waiting or pool.live:
            if waiting and pool.free():
                now, waiting = waiting[:pool.free()], waiting[pool.free():]
                pool.admit(now)
            for d in pool.run():
                generated += len(d.tokens)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - began
        print(json.dumps({"plain_pool_step": step, "rows": len(rows), "wall_s": round(wall, 4),
                          "tokens_mean": round(generated / len(rows), 1), "planned_mean": round(planned / len(rows), 1),
                          "longest": max(r[2].max_tokens for r in rows), "trajectories_per_s": round(len(rows) / wall, 1),
                          "model_tokens_per_s": round(generated / wall, 1)}), flush=True)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of the engine thread, the agent loop's, the gateway's HTTP server's and the rest of the
    process's threads together (Linux: /proc; empty elsewhere)."""
    import os
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "")
        key = {"rlspec-engine": "engine", "rlspec-agents": "agents", "rlspec-agent-gateway": "http"}.get(name, "other")
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _procs_cpu(procs) -> float:
    """CPU seconds so far of the agent processes (`rollout.agent.processes`; Linux: /proc)."""
    import os

    total = 0.0
    for proc in procs:
        try:
            fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _prefix(scheduler) -> dict:
    pool = scheduler.pool
    cache = getattr(getattr(pool, "prefills", None), "prefix", None)
    return dict(cache.stats) if cache is not None else {}


def _captured(scheduler) -> dict:
    """CUDA graphs captured so far (decode steps, and prefills with the extensions) and their seconds."""
    pool = scheduler.pool
    if pool is None:
        return {"decode_captures": 0, "prefill_captures": 0, "capture_s": 0.0}
    return {"decode_captures": pool._decode_captures, "prefill_captures": pool.prefills.captures,
            "capture_s": pool.capture_s}


if __name__ == "__main__":
    main()
