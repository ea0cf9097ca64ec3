"""Time the decode step's Triton kernels beside what they replace, on a GPU, at the 0.5B shape:
`skinny_linear` (split-K) against cuBLAS for the q/k/v, output, gate/up and down projections, and
`live_attention` against cuDNN's SDPA over the whole masked cache.

    python -m rlspec.perf.bench_decode_kernels [--layers 24]

Each figure is the median time of one call, from CUDA-graph replays of `--layers` calls on distinct weights or
caches (one per layer, as in a decode step, so a matrix is not still in L2 from the last call); the split-K
figure includes the sum of its parts (`.sum(0)` and the cast: a separate kernel here, fused into the next
element-wise kernel inside the compiled decode layer).

    python -m rlspec.perf.bench_decode_kernels --few-rows 4,16

sweeps instead the tiles of `gated_mlp` and `skinny_linear` at a few rows (the long tail's pools) beside a plain read
of each weight, live attention's parts (and block) over a long cache at those rows, and an empty kernel's floor (one
program, and two per SM), each as `graph_us` times it.

    python -m rlspec.perf.bench_decode_kernels --head [--heads 4]

times instead the LM head and its sampling at the 0.5B shape (hidden 896, vocabulary 151,936, bf16) at 16, 64 and
256 rows: the fused head and race (`sampled_head`) against `F.linear` then the compiled `exponential_race`, and
each of those two alone, over `--heads` distinct head weights (272 MB each) per replay.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from ..rollout.gated_mlp import config_for as gated_config_for
from ..rollout.gated_mlp import gated_mlp_eager
from ..rollout.live_attention import BLOCK_N as ATTENTION_BLOCK
from ..rollout.live_attention import live_attention_eager, sm_count, splits_for, triton
from ..rollout.skinny_linear import config_for, skinny_linear_eager

PROJECTIONS = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}
ATTENTION = ((64, 384, 134), (64, 384, 384), (16, 1152, 403), (64, 1152, 403), (256, 1152, 403))  # rows, cache, length


def graph_us(fn, calls: int, repeats: int = 15) -> float:
    """Median microseconds per call of `fn` (which makes `calls` calls), replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e6 / calls


def run(layers: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    sms = sm_count(0)
    rows = []
    for name, (n, k) in PROJECTIONS.items():
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(layers)]
        for m in (16, 64, 256):
            x = torch.randn(m, k, device=dev, dtype=dtype)
            config = config_for(m, n, k, sms)
            cublas = graph_us(lambda: [F.linear(x, w) for w in weights], layers)
            split = graph_us(lambda: [skinny_linear_eager(x, w, **config).sum(0).to(dtype) for w in weights], layers)
            parts = graph_us(lambda: [skinny_linear_eager(x, w, **config) for w in weights], layers)
            rows.append({"kernel": f"{name} {m}x{n}x{k}", "cublas_us": round(cublas, 2), "split_k_us": round(split, 2),
                         "split_k_parts_only_us": round(parts, 2), "splits": config["splits"]})
    for batch, length, live in ATTENTION:
        q = torch.randn(batch, 1, 14, 64, device=dev, dtype=dtype).transpose(1, 2)
        keys = [torch.randn(batch, 2, length, 64, device=dev, dtype=dtype) for _ in range(layers)]
        values = [torch.randn_like(c) for c in keys]
        valid = (torch.arange(length, device=dev)[None] < live).expand(batch, -1).contiguous()
        lengths = torch.full((batch,), live, device=dev)
        mask = torch.zeros(batch, 1, 1, length, device=dev, dtype=dtype).masked_fill_(~valid[:, None, None],
                                                                                       torch.finfo(dtype).min)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            sdpa = graph_us(lambda: [F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
                                     for kc, vc in zip(keys, values)], layers)
        splits = splits_for(batch, 2, length, sms)
        ours = graph_us(lambda: [live_attention_eager(q, kc, vc, valid.view(torch.uint8), lengths, 0.125, splits)
                                 for kc, vc in zip(keys, values)], layers)
        rows.append({"kernel": f"attention {batch} rows, cache {length}, {live} live", "cudnn_sdpa_us": round(sdpa, 2),
                     "live_us": round(ours, 2), "splits": splits})
    rows += skinny_rows(layers)
    rows += gated_mlp_rows(layers)
    return {"device": torch.cuda.get_device_name(0), "layers": layers, "rows": rows}


# (projection, splits, block_n, block_k, warps): `skinny_linear` tiles timed at 64 rows besides `config_for`'s
SKINNY_SWEEP = (("down", 10, 64, 128, 4), ("down", 19, 64, 256, 4), ("down", 19, 128, 256, 8), ("down", 5, 32, 128, 4),
                ("down", 10, 32, 128, 8), ("down", 19, 32, 256, 4), ("down", 38, 64, 128, 4), ("o", 7, 64, 128, 4),
                ("o", 4, 32, 256, 4), ("o", 7, 32, 128, 8), ("o", 4, 64, 256, 8), ("qkv", 7, 64, 128, 4),
                ("qkv", 4, 32, 256, 4), ("qkv", 7, 32, 128, 8))


def skinny_rows(layers: int, m: int = 64) -> list[dict]:
    """`skinny_linear` at `m` rows with each tile of `SKINNY_SWEEP`: its parts alone (the decode layer adds them
    inside the kernel that reads them next) and with their sum, beside cuBLAS."""
    from triton.runtime.errors import OutOfResources

    dev, dtype = torch.device("cuda"), torch.bfloat16
    out = []
    for name, splits, block_n, block_k, warps in SKINNY_SWEEP:
        n, k = PROJECTIONS[name]
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(layers)]
        x = torch.randn(m, k, device=dev, dtype=dtype)
        config = {"splits": splits, "block_m": 64, "block_n": block_n, "block_k": block_k, "warps": warps}
        cublas = graph_us(lambda: [F.linear(x, w) for w in weights], layers)
        try:
            parts = graph_us(lambda: [skinny_linear_eager(x, w, **config) for w in weights], layers)
        except OutOfResources as err:  # a tile too large for the device's shared memory
            out.append({"kernel": f"{name} {m}x{n}x{k} sweep", "config": config, "error": str(err)[:80]})
            continue
        split = graph_us(lambda: [skinny_linear_eager(x, w, **config).sum(0).to(dtype) for w in weights], layers)
        out.append({"kernel": f"{name} {m}x{n}x{k} sweep", "config": config, "cublas_us": round(cublas, 2),
                    "split_k_us": round(split, 2), "split_k_parts_only_us": round(parts, 2)})
    return out


# (rows, block_m, block_n, block_k, warps, stages): `gated_mlp` tiles to time at the 0.5B shape
GATED_SWEEP = ((64, 64, 16, 128, 4, 3), (64, 64, 32, 128, 4, 3), (64, 64, 64, 128, 4, 3), (64, 64, 16, 64, 4, 4),
               (64, 64, 32, 64, 4, 4), (64, 64, 16, 128, 8, 3), (64, 64, 32, 128, 8, 3), (64, 64, 16, 256, 4, 2),
               (64, 64, 32, 256, 8, 2), (64, 32, 32, 128, 4, 3), (64, 64, 16, 128, 4, 2), (64, 64, 32, 128, 4, 4),
               (16, 16, 16, 128, 4, 3), (16, 16, 32, 128, 4, 3), (16, 16, 64, 128, 4, 3))


def gated_mlp_rows(layers: int, hidden: int = 896, ffn: int = 4864) -> list[dict]:
    """`gated_mlp` (gate/up with silu(gate) * up in its epilogue) against what the decode layer runs without it:
    cuBLAS over the fused [2F, H] weight, then silu(gate) * up compiled into one kernel; at 16, 64 and 256 rows
    with `config_for`'s tiles, then each tile of `GATED_SWEEP`. `max_abs_diff`: the largest difference of the
    outputs (both bf16) over the last layer's weight."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    weights = [torch.randn(2 * ffn, hidden, device=dev, dtype=dtype) * 0.03 for _ in range(layers)]
    silu_mul = torch.compile(lambda gate_up: F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:], dynamic=False)
    out = []
    cases = [(m, gated_config_for(m)) for m in (16, 64, 256)]
    cases += [(m, {"block_m": bm, "block_n": bn, "block_k": bk, "warps": w, "stages": s})
              for m, bm, bn, bk, w, s in GATED_SWEEP]
    baseline = {}
    for m, config in cases:
        x = torch.randn(m, hidden, device=dev, dtype=dtype)
        if m not in baseline:
            gemm = graph_us(lambda: [F.linear(x, w) for w in weights], layers)
            both = graph_us(lambda: [silu_mul(F.linear(x, w)) for w in weights], layers)
            baseline[m] = (gemm, both)
        gemm, both = baseline[m]
        fused = graph_us(lambda: [gated_mlp_eager(x, w, **config) for w in weights], layers)
        diff = (gated_mlp_eager(x, weights[-1], **config).float() - silu_mul(F.linear(x, weights[-1])).float())
        out.append({"kernel": f"gated_mlp {m}x{ffn}x{hidden}", "config": config, "cublas_gate_up_us": round(gemm, 2),
                    "cublas_and_silu_us": round(both, 2), "gated_mlp_us": round(fused, 2),
                    "max_abs_diff": round(diff.abs().max().item(), 4)})
    return out


HEAD = (151_936, 896)  # the 0.5B shape's vocabulary and hidden size (its tied head)
# (block_m, block_n, block_k, warps, stages): `sampled_head` tiles timed at 64 rows besides `config_for`'s
HEAD_SWEEP = ((64, 128, 128, 8, 3), (64, 256, 64, 8, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 4),
              (64, 64, 128, 4, 4), (32, 128, 64, 4, 3), (64, 256, 128, 8, 2), (64, 128, 128, 4, 2))


def run_head(heads: int, temperature: float = 0.9) -> list[dict]:
    """The fused head and race against the head GEMM then the compiled race, as `graph_us` times them, over
    `heads` distinct weights and hidden states; `agree`: the fraction of rows whose tokens match (the rest are near
    ties resolved the other way: the two compute the logits in different orders)."""
    from ..rollout.noise import sample_keys
    from ..rollout.sampled_head import config_for as head_config, sampled_head_eager
    from ..rollout.sampling import exponential_race

    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    vocab, hidden = HEAD
    race = torch.compile(exponential_race, dynamic=False)
    weights = [torch.randn(vocab, hidden, device=dev, dtype=dtype) * 0.02 for _ in range(heads)]
    rows = []
    for m in (16, 64, 256):
        xs = [torch.randn(m, hidden, device=dev, dtype=dtype) for _ in range(heads)]
        keys = sample_keys(0, torch.arange(m, device=dev))
        steps = torch.full((m,), 7, device=dev)
        config = head_config(m)
        logits = [F.linear(x, w) for x, w in zip(xs, weights)]
        linear = graph_us(lambda: [F.linear(x, w) for x, w in zip(xs, weights)], heads)
        race_only = graph_us(lambda: [race(z, keys, steps, temperature) for z in logits], heads)
        unfused = graph_us(lambda: [race(F.linear(x, w), keys, steps, temperature) for x, w in zip(xs, weights)], heads)
        fused = graph_us(lambda: [sampled_head_eager(x, w, keys, steps, temperature, **config)
                                  for x, w in zip(xs, weights)], heads)
        tokens = sampled_head_eager(xs[0], weights[0], keys, steps, temperature, **config)[0]
        agree = (tokens == race(logits[0], keys, steps, temperature)[0]).float().mean().item()
        rows.append({"kernel": f"head + race {m}x{vocab}x{hidden}", "linear_us": round(linear, 2),
                     "race_us": round(race_only, 2), "linear_then_race_us": round(unfused, 2),
                     "fused_us": round(fused, 2), "agree": round(agree, 4), **config})
        del logits
        for block_m, block_n, block_k, warps, stages in (HEAD_SWEEP if m == 64 else ()):
            tiles = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "warps": warps, "stages": stages}
            swept = graph_us(lambda: [sampled_head_eager(x, w, keys, steps, temperature, **tiles)
                                      for x, w in zip(xs, weights)], heads)
            rows.append({"kernel": f"head + race {m}x{vocab}x{hidden}", "fused_us": round(swept, 2), **tiles})
    return rows


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _empty(out_ptr):
        if tl.program_id(0) == 0:
            tl.store(out_ptr, 1)

    @triton.jit
    def _read(x_ptr, out_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Read a contiguous CHUNK of x per program (its sum, stored, keeps the loads)."""
        start = tl.program_id(0) * CHUNK
        offsets = tl.arange(0, BLOCK)
        total = tl.zeros([BLOCK], tl.float32)
        for block in range(start, start + CHUNK, BLOCK):
            total += tl.load(x_ptr + block + offsets, mask=block + offsets < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(total, 0))


def read_floor_us(weights: list, layers: int, sms: int) -> tuple[float, int]:
    """The fastest plain read of each of `weights` (one kernel a weight, 1 to 8 programs per SM): what a kernel that
    only reads those bytes costs (microseconds), and its programs per SM."""
    n, block = weights[0].numel(), 2048
    out = torch.empty(8 * sms, device=weights[0].device)
    best = (float("inf"), 0)
    for per_sm in (1, 2, 4, 8):
        chunk = -(-n // (per_sm * sms * block)) * block
        grid = -(-n // chunk)
        us = graph_us(lambda: [_read[(grid,)](w, out, n, CHUNK=chunk, BLOCK=block) for w in weights], layers)
        best = min(best, (us, per_sm))
    return best


def _swept(kernel: str, config: dict, default: dict, fn, layers: int) -> list[dict]:
    """One sweep row: `fn` timed as `graph_us` times it, or none where the tile does not fit the device."""
    from triton.runtime.errors import OutOfResources

    try:
        us = graph_us(fn, layers)
    except OutOfResources:
        return []
    return [{"kernel": kernel, "config": config, "us": round(us, 2), "default": config == default}]


def few_rows(layers: int, row_counts: tuple[int, ...]) -> list[dict]:
    """The few-row sweep (`--few-rows`): what each decode kernel costs where the tail's pools run. Gate/up and
    attention at each row count, the split-K projections at the first; beside each weight its plain read."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    sms = sm_count(0)
    flag = torch.zeros(1, device=dev, dtype=torch.int32)
    out = [{"kernel": f"empty, {grid} programs",
            "us": round(graph_us(lambda: [_empty[(grid,)](flag) for _ in range(layers)], layers), 2)}
           for grid in (1, 2 * sms)]

    def read_row(name: str, weights: list) -> dict:
        us, per_sm = read_floor_us(weights, layers, sms)
        return {"kernel": f"read {name}'s weight", "us": round(us, 2), "programs_per_sm": per_sm,
                "tb_per_s": round(weights[0].numel() * 2 / us / 1e6, 2)}

    gate_up = [torch.randn(2 * 4864, 896, device=dev, dtype=dtype) * 0.03 for _ in range(layers)]
    out.append(read_row("gate_up", gate_up))
    for m in row_counts:
        x = torch.randn(m, 896, device=dev, dtype=dtype)
        # K blocks up to 1,024: the whole of K (896) in one block, every load issued at once
        tiles = itertools.product((16, 32, 64), (128, 256, 512, 1024), (4, 8), (1, 2, 3))
        for block_n, block_k, warps, stages in tiles:
            config = {"block_m": 16 if m <= 16 else 64, "block_n": block_n, "block_k": block_k, "warps": warps,
                      "stages": stages}
            out += _swept(f"gated_mlp {m} rows", config, gated_config_for(m),
                          lambda: [gated_mlp_eager(x, w, **config) for w in gate_up], layers)
    del gate_up
    m = row_counts[0]
    for name in ("qkv", "o", "down"):
        n, k = PROJECTIONS[name]
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(layers)]
        out.append(read_row(name, weights))
        x = torch.randn(m, k, device=dev, dtype=dtype)
        default = {**config_for(m, n, k, sms), "warps": 4, "stages": 3}
        for block_k, block_n, warps, stages in itertools.product((64, 128, 256), (16, 32), (4, 8), (1, 2, 3)):
            # one K block a part (every load issued at once), two, and the default's split
            for splits in sorted({-(-k // block_k), -(-k // (2 * block_k)), default["splits"]}):
                config = {"splits": splits, "block_m": default["block_m"], "block_n": block_n, "block_k": block_k,
                          "warps": warps, "stages": stages}
                out += _swept(f"{name} {m} rows", config, default,
                              lambda: [skinny_linear_eager(x, w, **config) for w in weights], layers)
        del weights
    length, live = 1152, 800
    for m in row_counts:
        q = torch.randn(m, 1, 14, 64, device=dev, dtype=dtype).transpose(1, 2)
        keys = [torch.randn(m, 2, length, 64, device=dev, dtype=dtype) for _ in range(layers)]
        values = [torch.randn_like(c) for c in keys]
        valid = torch.ones(m, length, device=dev, dtype=torch.uint8)
        lengths = torch.full((m,), live, device=dev)
        default = {"splits": splits_for(m, 2, length, sms), "block": ATTENTION_BLOCK}
        for splits, block in itertools.product(sorted({1, 2, 4, 7, default["splits"], 13}), (32, 64, 128)):
            config = {"splits": splits, "block": block}
            out += _swept(f"attention {m} rows, cache {length}, {live} live", config, default,
                          lambda: [live_attention_eager(q, kc, vc, valid, lengths, 0.125, splits, block=block)
                                   for kc, vc in zip(keys, values)], layers)
        del keys, values
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlspec.perf.bench_decode_kernels",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="distinct weights / caches per replay")
    parser.add_argument("--head", action="store_true", help="time the fused LM head and race instead")
    parser.add_argument("--heads", type=int, default=4, help="distinct head weights per replay (--head)")
    parser.add_argument("--few-rows", default="", help="sweep the decode kernels' tiles at these row counts (4,16)")
    args = parser.parse_args(argv)
    if args.few_rows:
        for row in few_rows(args.layers, tuple(int(r) for r in args.few_rows.split(","))):
            print(json.dumps(row), flush=True)
        print(json.dumps({"device": torch.cuda.get_device_name(0), "layers": args.layers}))
        return
    if args.head:
        for row in run_head(args.heads):
            print(json.dumps(row))
        print(json.dumps({"device": torch.cuda.get_device_name(0), "heads": args.heads}))
        return
    result = run(args.layers)
    for row in result["rows"]:
        print(json.dumps(row))
    print(json.dumps({"device": result["device"], "layers": result["layers"]}))


if __name__ == "__main__":
    main()
