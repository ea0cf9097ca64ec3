"""Time the fused log-prob head's two chunk kernels on a GPU (`rlspec.core.grpo`: `_head_stats`, the forward's
log-sum-exp / log-prob / entropy reduction, and `_head_grad`, the backward's logits gradient) at one chunk of
the bench's shape, under each way of compiling them, with the bytes each moves as a bandwidth.

    python -m rlspec.perf.bench_head [--positions 883] [--vocab 151936] [--repeats 50]

A chunk is [1, positions, vocab] bf16 logits (a packed micro-batch is one row); `--positions` defaults to what
`token_logprobs_and_entropy` cuts at the 0.5B shape's vocabulary. Each mode is warmed on two chunk sizes (the
full one and a shorter last chunk) first, as a train step does, so automatic-dynamic compiling has recompiled
before it is timed.
"""

from __future__ import annotations

import argparse
import json

import torch

from ..core.grpo import FUSED_CHUNK_ELEMS, _head_grad, _head_stats

MODES = {"dynamic": dict(dynamic=True), "automatic": dict(dynamic=None)}


def time_ms(fn, repeats: int) -> float:
    """Median milliseconds of `fn()` over `repeats` CUDA-event-timed calls."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def run(positions: int, vocab: int, repeats: int) -> dict:
    torch.manual_seed(0)
    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(), "positions": positions, "vocab": vocab}
    logits_bytes = positions * vocab * 2
    source = torch.randn(1, positions, vocab, device=device, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    copy = time_ms(lambda: target.copy_(source), repeats)  # the baseline: one read and one write of the logits
    results["copy"] = {"ms": copy, "tb_s": 2 * logits_bytes / copy / 1e9}
    del source, target
    for name, options in MODES.items():
        torch._dynamo.reset()
        stats, grad = torch.compile(_head_stats, **options), torch.compile(_head_grad, **options)
        for rows in (positions, positions // 3):  # a full chunk and a last, shorter one
            logits = torch.randn(1, rows, vocab, device=device, dtype=torch.bfloat16)
            targets = torch.randint(vocab, (1, rows), device=device)
            _, _, lse = stats(logits, targets, 1.0)
            grad(logits, targets, lse, torch.ones(1, rows, device=device), 1.0)
        logits = torch.randn(1, positions, vocab, device=device, dtype=torch.bfloat16)
        targets = torch.randint(vocab, (1, positions), device=device)
        upstream = torch.ones(1, positions, device=device)
        _, _, lse = stats(logits, targets, 1.0)
        forward = time_ms(lambda: stats(logits, targets, 1.0), repeats)
        backward = time_ms(lambda: grad(logits, targets, lse, upstream, 1.0), repeats)
        results[name] = {"forward_ms": forward, "backward_ms": backward,
                         "forward_read_tb_s": logits_bytes / forward / 1e9,  # one read of the logits
                         "backward_tb_s": 2 * logits_bytes / backward / 1e9}  # a read and a write
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=FUSED_CHUNK_ELEMS // 151936)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.positions, args.vocab, args.repeats), indent=1))


if __name__ == "__main__":
    main()
