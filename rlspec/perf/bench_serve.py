"""`python -m rlspec.perf.bench_serve`: concurrent streaming chat requests against a running `rlspec serve`.

    rlspec serve examples/tiny.yaml model=qwen2_0p5b_shape hardware=gpu1 --port 8000 &
    python -m rlspec.perf.bench_serve --url http://127.0.0.1:8000 --requests 64 --max-tokens 64

Sends `--requests` streaming chat completions at once (httpx; each its own seed)
and prints one JSON object: requests/s over the whole batch, p50/p99 time to the first content chunk and to
the last chunk, the tokens received, and the server's `/health` (whose `sampler` says whether the CUDA-graph
sampler served them). The server samples one request at a time and streams its tokens after sampling them,
so the time to first token of a request includes the requests queued before it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _one(http, model: str, seed: int, max_tokens: int, started: float) -> tuple[float, float, int]:
    """(time to the first content chunk, time to the end, content chunks) of one streamed chat request."""
    first, chunks = None, 0
    body = {"model": model, "messages": [{"role": "user", "content": f"Count from {seed} onwards."}],
            "max_tokens": max_tokens, "seed": seed, "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                if choice["delta"].get("content"):
                    chunks += 1
                    first = first if first is not None else time.perf_counter() - started
    return (first if first is not None else time.perf_counter() - started), time.perf_counter() - started, chunks


async def _bench(url: str, requests: int, max_tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=600.0,
                                 limits=httpx.Limits(max_connections=requests + 1)) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        await _one(http, model, 0, 4, time.perf_counter())  # warm-up: what a first request compiles and captures
        started = time.perf_counter()
        results = await asyncio.gather(*(_one(http, model, seed, max_tokens, started) for seed in range(1, requests + 1)))
        wall_s = time.perf_counter() - started
        health = (await http.get("/health")).json()
    ttft = [r[0] for r in results]
    total = [r[1] for r in results]
    return {"requests": requests, "max_tokens": max_tokens, "wall_s": round(wall_s, 3),
            "requests_per_s": round(requests / wall_s, 3), "ttft_p50_s": round(statistics.median(ttft), 4),
            "ttft_p99_s": round(_quantile(ttft, 0.99), 4), "latency_p50_s": round(statistics.median(total), 4),
            "latency_p99_s": round(_quantile(total, 0.99), 4), "content_chunks": sum(r[2] for r in results),
            "sampler": health.get("sampler"), "model": health.get("model")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlspec.perf.bench_serve", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(_bench(args.url.rstrip("/"), args.requests, args.max_tokens))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
