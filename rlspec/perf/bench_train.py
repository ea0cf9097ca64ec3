"""The train phase alone, padded against packed: `python -m rlspec.perf.bench_train [--rows 64,256] [--json OUT]`.

One optimizer update (`rlspec.core.policy.accumulate` + the optimizer step) of a synthetic batch, repeated,
for each of: the padded path with `micro_batch_size` rows per micro-batch, the packed path with the same
rows, and the packed path with token budgets (`algorithm.micro_batch_tokens`). Two batches per row count:
`uniform` (every sequence 20 prompt + 256 completion tokens, as in `examples/bench_qwen0p5b.yaml`) and `spread`
(20 prompt + a completion length drawn uniformly from 16..512 with a fixed seed, right-padded to the longest).
Prints and writes, per variant: median wall seconds after one warm-up, real tokens per second, the share of
the padded batch that is padding, peak memory, and on a known GPU in 16 bits the MFU as `rlspec bench`
counts it (real tokens only). Sampling and rewards are left out: this is the train phase's own speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

VARIANTS = (("padded", False, 0), ("packed", True, 0), ("packed_tokens_8k", True, 8192),
            ("packed_tokens_16k", True, 16384))


def synthetic_batch(rows: int, completion_lengths: list[int], prompt: int, vocab: int, seed: int):
    from ..core.batch import TrainBatch

    gen = torch.Generator().manual_seed(seed)
    lengths = [prompt + n for n in completion_lengths]
    width = max(lengths)
    ids = torch.randint(3, vocab, (rows, width), generator=gen)
    attention = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    loss_mask = attention.float()
    loss_mask[:, :prompt] = 0.0
    return TrainBatch(input_ids=ids, attention_mask=attention, loss_mask=loss_mask,
                      advantages=torch.randn(rows, generator=gen), rewards=torch.zeros(rows))


def time_update(model, optimizer, batch, micro_batch_size: int, budget: int, packed: bool, device, reps: int) -> float:
    """Median wall seconds of one update over `reps` after a warm-up."""
    from ..core import policy
    from ..core.grpo import LossConfig, LossNorm

    norm = LossNorm.of(batch.loss_mask, 512)
    shard, sizes = batch.token_shards(1, budget)[0] if budget else (batch, None)
    packs = policy.packs
    policy.packs = packs if packed else (lambda model, batch: False)  # the padded path, for comparison
    try:
        walls = []
        for _ in range(reps + 1):
            _sync(device)
            start = time.perf_counter()
            policy.accumulate(model, shard, micro_batch_size, norm, LossConfig(), 1.0, lambda loss: loss.backward(),
                              device, sizes)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            walls.append(time.perf_counter() - start)
    finally:
        policy.packs = packs
    return statistics.median(walls[1:])


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m rlspec.perf.bench_train", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2_0p5b_shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attn", default="sdpa", help="model.attn_implementation")
    parser.add_argument("--rows", default="64,256", help="sequences per update, comma-separated")
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    from ..core.trainer import build_optimizer
    from ..models.factory import load_model
    from ..spec import AlgorithmSpec, ModelSpec
    from .bench import PEAK_BF16_TFLOPS

    model = load_model(ModelSpec(preset=args.preset, dtype=args.dtype, attn_implementation=args.attn), 0)
    model = model.to(args.device).train()
    optimizer = build_optimizer(model.parameters(), AlgorithmSpec(lr=1e-6))
    config = model.config
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attn_width = config.num_hidden_layers * config.num_attention_heads * head_dim
    peak = None
    if args.device.startswith("cuda") and args.dtype != "float32":
        name = torch.cuda.get_device_name(0)
        peak = next((t * 1e12 for key, t in PEAK_BF16_TFLOPS.items() if key in name), None)
    gen = torch.Generator().manual_seed(0)
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        batches = {"uniform": [256] * rows, "spread": torch.randint(16, 513, (rows,), generator=gen).tolist()}
        for shape, completions in batches.items():
            batch = synthetic_batch(rows, completions, 20, config.vocab_size, seed=rows)
            real = float(batch.attention_mask.sum())
            flops = 3 * real * (2 * matmul_params + 2 * real / rows * attn_width)  # `rlspec bench`'s count
            for variant, packed, budget in VARIANTS:
                if args.device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                wall = time_update(model, optimizer, batch, args.micro_batch_size, budget, packed, args.device,
                                   args.reps)
                row = {"wall_s": round(wall, 4), "real_tokens_per_s": round(real / wall),
                       "padding_share": round(1 - real / batch.attention_mask.numel(), 3),
                       "mfu": round(flops / (wall * peak), 4) if peak else None,
                       "peak_gb": (round(torch.cuda.max_memory_allocated() / 2**30, 2)
                                   if args.device.startswith("cuda") else None)}
                results[f"{rows} {shape} {variant}"] = row
                print(f"{rows:>5} {shape:<8} {variant:<18} {json.dumps(row)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
