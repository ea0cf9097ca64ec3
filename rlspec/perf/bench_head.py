"""Time the train step's log-prob head at one chunk of the bench's shape on a GPU.

- `compiled`: the unfused chunk's two elementwise kernels (`rlspec.core.grpo`: `_head_stats`, the forward's
  log-sum-exp / log-prob / entropy reduction over the logits, and `_head_grad`, the backward's logits gradient)
  under each way of compiling them, with the bytes each moves as a bandwidth;
- `chunk`: the Triton kernels that replace them (`rlspec.core.fused_head`) alone, and a whole chunk, forward and
  backward (cuBLAS logits, the reductions, the gradient's two GEMMs), with each, beside cuBLAS's logits GEMM
  alone;
- `sweep` (with `--sweep`): the Triton kernels at other block sizes.

    python -m rlspec.perf.bench_head [--positions 883] [--vocab 151936] [--hidden 896] [--repeats 50] [--sweep]

A chunk is [1, positions, vocab] bf16 logits (a packed micro-batch is one row); `--positions` defaults to what
`token_logprobs_and_entropy` cuts at the 0.5B shape's vocabulary. Each mode is warmed on two chunk sizes (the
full one and a shorter last chunk) first, as a train step does, so automatic-dynamic compiling has recompiled
before it is timed.
"""

from __future__ import annotations

import argparse
import json

import torch

from ..core import fused_head
from ..core.grpo import FUSED_CHUNK_ELEMS, _compiled, _head_grad, _head_stats

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


def run(positions: int, vocab: int, hidden: int, repeats: int, sweep: bool) -> dict:
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
    torch._dynamo.reset()
    results["chunk"] = _chunk(positions, vocab, hidden, repeats)
    if sweep:
        results["sweep"] = _sweep(positions, vocab, hidden, repeats)
    return results


def _operands(positions: int, vocab: int, hidden: int):
    device = torch.device("cuda")
    states = torch.randn(positions, hidden, device=device, dtype=torch.bfloat16)
    weight = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16) / hidden ** 0.5
    targets = torch.randint(vocab, (positions,), device=device)
    return states, weight, targets, torch.ones(positions, device=device)


def _chunk(positions: int, vocab: int, hidden: int, repeats: int) -> dict:
    """One chunk's forward and backward as `_ChunkedLogprobs` runs them: cuBLAS logits with the compiled
    reductions and with the Triton ones."""
    states, weight, targets, upstream = _operands(positions, vocab, hidden)
    stats, grad = _compiled(_head_stats), _compiled(_head_grad)
    grad_weight = torch.zeros_like(weight)
    logits = torch.nn.functional.linear(states, weight)
    lse = fused_head.head_stats(logits, targets, 1.0)[2]

    def gradient_gemms(g):
        torch.matmul(g, weight)
        grad_weight.addmm_(g.t(), states)

    def compiled_backward():
        logits = torch.nn.functional.linear(states, weight)[None]
        gradient_gemms(grad(logits, targets[None], lse[None], upstream[None], 1.0)[0])

    def triton_backward():
        fresh = torch.nn.functional.linear(states, weight)
        gradient_gemms(fused_head.head_logits_grad_(fresh, targets, lse, upstream, 1.0))

    runs = {
        "cublas_logits_ms": lambda: torch.nn.functional.linear(states, weight),
        "triton_stats_ms": lambda: fused_head.head_stats(logits, targets, 1.0),
        "triton_grad_ms": lambda: fused_head.head_logits_grad_(logits, targets, lse, upstream, 1.0),
        "compiled_forward_ms": lambda: stats(torch.nn.functional.linear(states, weight)[None], targets[None], 1.0),
        "triton_forward_ms": lambda: fused_head.head_stats(torch.nn.functional.linear(states, weight), targets, 1.0),
        "compiled_backward_ms": compiled_backward,
        "triton_backward_ms": triton_backward,
    }
    out = {}
    for name, fn in runs.items():
        fn()
        out[name] = time_ms(fn, repeats)
    logits_bytes = positions * vocab * 2
    out["triton_stats_read_tb_s"] = logits_bytes / out["triton_stats_ms"] / 1e9
    out["triton_grad_tb_s"] = 2 * logits_bytes / out["triton_grad_ms"] / 1e9
    compiled = out["compiled_forward_ms"] + out["compiled_backward_ms"]
    out["triton_saved"] = 1 - (out["triton_forward_ms"] + out["triton_backward_ms"]) / compiled
    return out


def _sweep(positions: int, vocab: int, hidden: int, repeats: int) -> list[dict]:
    """The two Triton kernels at each block size (columns a program reads per step)."""
    states, weight, targets, upstream = _operands(positions, vocab, hidden)
    logits = torch.nn.functional.linear(states, weight)
    lse = fused_head.head_stats(logits, targets, 1.0)[2]
    rows = []
    for block in (1024, 2048, 4096, 8192):
        stats = time_ms(lambda: fused_head.head_stats(logits, targets, 1.0, block), repeats)
        grad = time_ms(lambda: fused_head.head_logits_grad_(logits, targets, lse, upstream, 1.0, block), repeats)
        rows.append({"block": block, "stats_ms": stats, "grad_ms": grad})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=FUSED_CHUNK_ELEMS // 151936)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time the Triton kernels at other block sizes")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.positions, args.vocab, args.hidden, args.repeats, args.sweep), indent=1))


if __name__ == "__main__":
    main()
