"""A turn's prefill with prefix reuse against a full prefill of the same context (`rlspec.serve.kv.prefix.PrefixCache`):
the spec's model in a serving pool; `--rows` rows of `--context`-token prompts admitted and decoded `--tokens` tokens
each (turn 1), then their next turn (prompt + sampled tokens + a `--tool`-token result) admitted twice: into the
pool that kept turn 1's K/V (prefix reuse), and into the same pool with its prefix cache emptied (a full prefill of
the whole context), every match reused (`prefill.GRAPH_MIN_REUSED` set to 0: it only matters for turns the captured
extension cannot take). The admission's seconds (the engine's clock after a device sync; the median of `--repeats`,
after a warm-up), one JSON line per row count; `served_vs_full`: the path the pool takes as it serves (a turn the
captured extension cannot take reuses only past `GRAPH_MIN_REUSED` reused tokens); `captured`: the admission's turns
went through a captured extension forward.
    python tests/gpu/probe_prefix.py examples/bench_qwen0p5b.yaml --context 2048 --rows 1,8,64"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--tool", type=int, default=50)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="then one more reuse admission of each row count under torch.profiler: its wall, the "
                             "device's busy time, and the ops that took the most host and device time")
    args = parser.parse_args()

    import torch

    from rlspec.run import build_plan
    from rlspec.serve.pool import RowSampling
    from rlspec.serve.process import build_engine
    from rlspec.serve.scheduler import make_pool

    from rlspec.serve.kv import prefill

    served_min = prefill.GRAPH_MIN_REUSED  # what the pool serves with: reuse only past this many reused tokens
    prefill.GRAPH_MIN_REUSED = 0  # every match reused, whatever an admission saves: the cost of reuse itself
    need = args.context + args.tokens + args.tool + 64
    plan, _ = build_plan(args.spec, [*args.overrides, f"rollout.max_prompt_tokens={need}",
                                     f"rollout.max_new_tokens={args.tokens}"])
    if plan.spec.hardware.num_threads:  # as `rlspec run` does
        torch.set_num_threads(plan.spec.hardware.num_threads)
    engine = build_engine(plan)
    pool = make_pool(engine)
    top = min(20000, len(engine.tokenizer))
    device = engine.device
    sync = (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else (lambda: None)
    key = iter(range(1, 1 << 30))

    def admit(prompts) -> float:
        sync()
        began = time.perf_counter()
        pool.admit([(i, p, RowSampling(next(key), args.tokens)) for i, p in enumerate(prompts)])
        sync()
        return time.perf_counter() - began

    def finish() -> dict[int, list[int]]:
        got: dict[int, list[int]] = {}
        while pool.live:
            for d in pool.run():
                got.setdefault(d.row_id, []).extend(d.tokens)
        return got

    def next_turn(rows: int, seed: int) -> list[list[int]]:
        """Turn 1 of `rows` new conversations admitted and decoded (their K/V kept as they end); their turn 2."""
        gen = torch.Generator().manual_seed(seed)
        first = [torch.randint(32, top, (args.context,), generator=gen).tolist() for _ in range(rows)]
        admit(first)
        sampled = finish()
        tool = torch.randint(32, 127, (args.tool,), generator=gen).tolist()
        return [first[i] + sampled[i] + tool for i in range(rows)]

    for rows in [int(r) for r in args.rows.split(",")]:
        reuse, full, hits = [], [], 0
        for repeat in range(args.repeats + 1):
            turn = next_turn(rows, 1000 * rows + repeat)
            before = dict(pool.prefills.prefix.stats)
            took_reuse = admit(turn)
            hits = pool.prefills.prefix.stats["hits"] - before["hits"]
            reused = pool.prefills.prefix.stats["reused_tokens"] - before["reused_tokens"]
            captured = pool.prefills.prefix.stats["captured"] - before["captured"] == hits > 0
            finish()
            pool.prefills.prefix.clear()
            pool.prefills.cache.clear()
            took_full = admit(turn)
            finish()
            pool.prefills.cache.clear()
            if repeat:  # the first is a warm-up (graphs, allocator)
                reuse.append(took_reuse)
                full.append(took_full)
        r, f = statistics.median(reuse), statistics.median(full)
        # as served: captured extensions always reuse; eager ones only past `GRAPH_MIN_REUSED` reused tokens (on CUDA)
        served = r if captured or reused >= served_min or not pool.prefills.packed else f
        print(json.dumps({"rows": rows, "context": len(turn[0]), "new_tokens": args.tool, "prefix_hits": hits,
                          "admit_reuse_s": round(r, 5), "admit_full_s": round(f, 5), "reuse_vs_full": round(r / f, 3),
                          "served_vs_full": round(served / f, 3), "served_reuses": served is r,
                          "captured": captured,
                          "reuse_all_s": [round(x, 5) for x in reuse], "full_all_s": [round(x, 5) for x in full]}),
              flush=True)
        if args.profile:
            profile_reuse(next_turn(rows, 1000 * rows + args.repeats + 1), admit, finish)


def profile_reuse(turn: list[list[int]], admit, finish) -> None:
    """The admission of `turn` into the pool that kept its prefixes, under torch.profiler: where its time goes (host
    or device, and which ops)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        wall = admit(turn)
    finish()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) if cuda else 0.0
    print(json.dumps({"profiled_rows": len(turn), "wall_s": round(wall, 5), "device_busy_s": round(device_us / 1e6, 5),
                      "host_ops": sum(e.count for e in events if not e.key.startswith(("cuda", "Memcpy", "Memset")))}),
          flush=True)
    if cuda:
        print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70), flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70), flush=True)


if __name__ == "__main__":
    main()
