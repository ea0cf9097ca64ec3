"""`python -m rlspec.perf.bench_serve`: `rlspec serve` under concurrent streaming requests, beside the in-process
engine's batched generate of the same tokens.

    python -m rlspec.perf.bench_serve examples/bench_qwen0p5b.yaml --concurrency 1,16,64,256 \\
        --prompt-tokens 32 --output-tokens 64 --json out.json

With a SPEC it starts the spec's server as a child process (`ServerProcess`, with `--warm-pool`: warm-up bursts need
not reach every pool size, and on one H100 a 256-stream burst once waited 2.3 s for its pool's first capture), runs
the sweep against it, stops it, then builds the same engine in this process and times `engine.generate` of the same
prompts and lengths (the batched rollout a trainer runs; `engine_tokens_per_s`). With `--url` it benches a running
server and skips that comparison. At each concurrency C: two warm-up bursts of C requests (what a first burst of that
size compiles and captures), then C streaming requests at once, each its own prompt of `--prompt-tokens` random token
ids (or, with `--api chat`, a user message of about that many tokens) and `--output-tokens` tokens. Printed per C, one
JSON line: requests/s and output tokens/s over the burst (its streams spread over `--clients` client processes: by
default one per 16 streams, up to half the cores), time to first token and inter-token latency (a chunk's gap over the
tokens it carries) p50/p99, and the engine's tokens/s beside it (`serve_vs_engine`: the ratio); `server_admits`,
`server_admit_s`, `server_steps`, `server_decode_s`, `server_slow_decodes`, `server_captures`, `server_capture_s`,
`server_gc_s`: what the server's engine thread did during the burst (`GET /health`'s scheduler counters);
`client_cpu_share`: the busiest client process's CPU seconds over the burst's wall time (near 1: the client itself
bounds the figures). `--engine-process` (default on, as `rlspec serve`'s) starts the server with its engine in a
process of its own or not."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from typing import Callable


STREAMS_PER_CLIENT = 16
"""`--clients` by default: a client process per this many streams. One H100 machine's client (httpx, one process)
spent 76% and 98% of a core during bursts of 64 and 256 streams: the figures were the client's as much as the server's."""


def auto_clients(streams: int) -> int:
    return max(1, min(-(-streams // STREAMS_PER_CLIENT), (os.cpu_count() or 2) // 2))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def prompts_for(count: int, prompt_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts of random token ids below `vocab` (the first few ids left out: specials in a small one)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(prompt_tokens)] for _ in range(count)]


async def _one(http, api: str, model: str, prompt: list[int], max_tokens: int, seed: int,
               started: float) -> tuple[float, list[float], int]:
    """(time to the first token, per-token gaps after it, tokens received) of one streamed request."""
    if api == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": " ".join(map(str, prompt))}],
                "max_tokens": max_tokens, "seed": seed, "stream": True, "logprobs": True}
        path = "/v1/chat/completions"
    else:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "seed": seed, "stream": True, "logprobs": 0}
        path = "/v1/completions"
    first, last, gaps, tokens = None, None, [], 0
    async with http.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                lp = choice.get("logprobs")
                count = len(lp["content"] if api == "chat" else lp["tokens"]) if lp else 0
                if not count:
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now - started
                else:
                    gaps += [(now - last) / count] * count
                last, tokens = now, tokens + count
    return (first if first is not None else time.perf_counter() - started), gaps, tokens


async def _share(url: str, api: str, prompts: list[list[int]], indices: list[int], max_tokens: int, seed: int,
                 between_warmups: Callable[[], None], start: Callable[[], float]) -> tuple[list, float, float]:
    """One client's streams of a burst: two warm-up rounds (what a first burst of that size compiles and captures),
    `between_warmups` after each, then its streams from the time `start` returns. (results, end time, CPU seconds)."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=600.0, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for warm_tokens in (4, max_tokens):
            await asyncio.gather(*(_one(http, api, model, p, warm_tokens, seed + 7919 + i, time.perf_counter())
                                   for i, p in zip(indices, prompts)))
            await asyncio.to_thread(between_warmups)
        started = await asyncio.to_thread(start)
        cpu = time.process_time()
        results = await asyncio.gather(*(_one(http, api, model, p, max_tokens, seed + i, started)
                                         for i, p in zip(indices, prompts)))
        return results, time.perf_counter(), time.process_time() - cpu


def _client_process(url, api, prompts, indices, max_tokens, seed, barrier, go, start_at, out) -> None:
    """A client process of a burst (`_burst` with `clients` > 1): its share, sent back through `out`."""
    def start() -> float:
        go.wait()
        return start_at.value

    try:
        out.put(asyncio.run(_share(url, api, prompts, indices, max_tokens, seed, barrier.wait, start)))
    except BaseException as err:  # noqa: BLE001 - the parent raises it
        barrier.abort()
        out.put(RuntimeError(f"client process: {type(err).__name__}: {err}"))


def _health(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/health", trust_env=False, timeout=60.0).json()


async def _burst(url: str, api: str, prompts: list[list[int]], max_tokens: int, seed: int, clients: int = 1) -> dict:
    """The streams of one concurrency level: every prompt at once, from `clients` client processes (one: this
    process) so that the client's own interpreter does not bound what is measured."""
    clients = max(1, min(clients, len(prompts)))
    if clients == 1:
        state: dict = {}

        def start() -> float:
            state["before"] = _health(url)
            state["started"] = time.perf_counter()
            return state["started"]

        shares = [await _share(url, api, prompts, list(range(len(prompts))), max_tokens, seed, lambda: None, start)]
        before, started = state["before"], state["started"]
    else:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        barrier, go, start_at, out = context.Barrier(clients + 1), context.Event(), context.Value("d", 0.0), context.Queue()
        parts = [list(range(k, len(prompts), clients)) for k in range(clients)]
        procs = [context.Process(target=_client_process, args=(url, api, [prompts[i] for i in part], part, max_tokens,
                                                               seed, barrier, go, start_at, out), daemon=True)
                 for part in parts]
        for proc in procs:
            proc.start()
        try:
            for _ in range(2):  # the two warm-up rounds, every client's together
                await asyncio.to_thread(barrier.wait, 600)
            before = _health(url)
            start_at.value = time.perf_counter()
            go.set()
            shares = [await asyncio.to_thread(out.get, True, 600) for _ in procs]
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
        failed = [s for s in shares if isinstance(s, BaseException)]
        if failed:
            raise failed[0]
        started = start_at.value
    health = _health(url)
    results = [r for share in shares for r in share[0]]
    wall_s = max(share[1] for share in shares) - started
    client_cpu = max(share[2] for share in shares) / wall_s
    before, after = before.get("scheduler") or {}, health.get("scheduler") or {}
    server = {f"server_{k}": round(after[k] - before.get(k, 0), 4) for k in ("admits", "admit_s", "steps", "decode_s",
                                                                            "slow_decodes", "captures", "capture_s", "gc_s")
              if k in after}  # the engine thread's admissions and decode runs during the measured burst
    ttft = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    tokens = sum(r[2] for r in results)
    return {"concurrency": len(prompts), "clients": clients, "wall_s": round(wall_s, 4),
            "requests_per_s": round(len(prompts) / wall_s, 2),
            "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall_s, 1),
            "ttft_p50_ms": round(statistics.median(ttft) * 1e3, 2), "ttft_p99_ms": round(_quantile(ttft, 0.99) * 1e3, 2),
            "itl_p50_ms": round(_quantile(gaps, 0.5) * 1e3, 3), "itl_p99_ms": round(_quantile(gaps, 0.99) * 1e3, 3),
            "sampler": health.get("sampler"), "batching": after.get("batching"),
            "max_rows_in_flight": after.get("max_rows_in_flight"), "client_cpu_share": round(client_cpu, 3), **server}


ENGINE_REPEATS = 3
"""Timed calls of the engine's batched generate per level: single calls of 0.2-0.4 s (256 rows) ranged 50-80k
tokens/s between sweeps on H100s, so the ratio takes their median."""


def engine_tokens_per_s(engine, prompts: list[list[int]], max_tokens: int, seed: int) -> dict:
    """The in-process engine's batched generate of the same prompts and lengths: the median of `ENGINE_REPEATS`
    timed calls after one warm-up call."""
    import dataclasses

    import torch

    view = engine.with_spec(dataclasses.replace(engine.spec, max_new_tokens=max_tokens))
    view.generate(prompts, 1, seed=seed)  # compiles and captures this batch's pools
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    walls = []
    for _ in range(ENGINE_REPEATS):
        started = time.perf_counter()
        rollout = view.generate(prompts, 1, seed=seed)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        walls.append(time.perf_counter() - started)
    wall_s = statistics.median(walls)
    tokens = sum(len(c) for c in rollout.completion_ids)
    return {"engine_wall_s": round(wall_s, 4), "engine_walls_s": [round(w, 4) for w in walls],
            "engine_output_tokens": tokens, "engine_tokens_per_s": round(tokens / wall_s, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlspec.perf.bench_serve", description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", help="start this spec's server (and time its engine in-process)")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--url", help="bench a running server instead (no in-process comparison)")
    parser.add_argument("--concurrency", default="1,16,64,256", help="comma-separated stream counts")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--api", choices=("completions", "chat"), default="completions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--clients", type=int, default=0,
                        help="client processes the streams of a level are spread over (default: one per "
                             f"{STREAMS_PER_CLIENT} streams, up to half this machine's cores)")
    parser.add_argument("--engine-process", choices=("off", "on"), default="on",
                        help="the started server's --engine-process (default on, as rlspec serve's)")
    args = parser.parse_args(argv)
    if (args.spec is None) == (args.url is None):
        parser.error("give a SPEC (the bench starts its server) or --url (a running server)")
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    plan = server = None
    if args.spec is not None:
        from ..run import build_plan
        from ..serve.client import ServerClient
        from ..serve.process import ServerProcess

        plan, _ = build_plan(args.spec, args.overrides)
        server = ServerProcess(plan, engine_process=args.engine_process, warm_pool=True)
        server.start()
        ServerClient(server.url, server.token, 60, server.describe).wait_healthy(600, server.alive)
        warmed = [line for line in server.log_path.read_text(errors="replace").splitlines() if " warmed: " in line]
        print(warmed[-1] if warmed else "rlspec serve: no warm-up line in the server's log", flush=True)
    url = (args.url or server.url).rstrip("/")
    vocab = 256  # a running server's vocabulary is not known here: ids every tokenizer has
    if plan is not None:
        from ..models.factory import load_tokenizer

        vocab = min(len(load_tokenizer(plan.spec.model)), 30000)
    try:
        for c in levels:
            prompts = prompts_for(c, args.prompt_tokens, vocab, args.seed + c)
            row = {"prompt_tokens": args.prompt_tokens, "max_tokens": args.output_tokens, "api": args.api,
                   "engine_process": args.engine_process if args.url is None else None,
                   **asyncio.run(_burst(url, args.api, prompts, args.output_tokens, args.seed,
                                        args.clients or auto_clients(c)))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if server is not None:
            server.stop()
    if plan is not None:
        from ..serve.process import build_engine

        engine = build_engine(plan)
        for row in rows:
            prompts = prompts_for(row["concurrency"], args.prompt_tokens, vocab, args.seed + row["concurrency"])
            if args.api == "chat":
                prompts = [engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": " ".join(map(str, p))}], add_generation_prompt=True, tokenize=True)
                    for p in prompts]
                prompts = [list(p["input_ids"] if isinstance(p, dict) else p) for p in prompts]
            row.update(engine_tokens_per_s(engine, prompts, args.output_tokens, args.seed))
            row["serve_vs_engine"] = round(row["output_tokens_per_s"] / row["engine_tokens_per_s"], 3)
            print(json.dumps({"concurrency": row["concurrency"], **{k: v for k, v in row.items() if k.startswith(("engine", "serve_vs"))}}),
                  flush=True)
    print("\nstreams  req/s  out tok/s  TTFT p50/p99 ms  ITL p50/p99 ms  engine tok/s  serve/engine", file=sys.stderr)
    for r in rows:
        print(f"{r['concurrency']:7d} {r['requests_per_s']:6.1f} {r['output_tokens_per_s']:10.0f} "
              f"{r['ttft_p50_ms']:8.1f}/{r['ttft_p99_ms']:<8.1f} {r['itl_p50_ms']:7.2f}/{r['itl_p99_ms']:<7.2f} "
              f"{r.get('engine_tokens_per_s', float('nan')):12.0f} {r.get('serve_vs_engine', float('nan')):8.3f}",
              file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
