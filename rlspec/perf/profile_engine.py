"""Where the CUDA engine's generation time goes, on one GPU: `python -m rlspec.perf.profile_engine SPEC [overrides]`.

On the standalone backend's engine and the spec's rollout batch (`prompts_per_step x group_size` rows,
`max_new_tokens` each), prints:

- `engine.generate` wall time, median of `--repeats` (what `rlspec bench` reports as `timing_s/gen`, less the
  reward), with the spec's sampler settings and again with `rollout.continuous_batching` flipped (continuous
  batching against the static batch, the same seeds), each with its completion lengths (mean, p50, p90, max);
- for each sampler variant of `--variants`: the whole batch's wall time as the engine runs it (graphs captured
  per batch), and its split: prefill, graph capture, one decode step (median over graph replays);
- the weight-read floor of a decode step: the parameters' bytes over the device-to-device copy bandwidth;
- the GPU kernels of the first variant's decode step, from graph replays and from the same step run eagerly
  (torch.profiler).

Variants (keyword arguments of `GraphSampler`): `plain` (compiled blocks, separate projections), `fused`
(q/k/v and gate/up each one GEMM), `sdpa` (attention through `scaled_dot_product_attention`), `fused_sdpa`,
`fused_eager` (fused, blocks not compiled), `fused_layers` (fused, one compiled function per decoder layer
instead of one per block), `fused_layers_sdpa` (the default; where Triton runs, decode steps attend with
`live_attention`, reading only each row's reached positions, with RoPE and the new K/V's cache writes in the
same kernel (`rope_attention`, which also sums the split-K parts of q/k/v: `skinny_qkv`), run the output and
down projections split-K with `skinny_linear` and gate/up with silu(gate) * up as one kernel, `gated_mlp`, at up
to 64 rows, and, without top-p, sample with the LM head and the race as one kernel, `sampled_head`, so no
[rows, V] logits are written),
`fused_layers_sdpa_ungated` (the default less `gated_mlp`), `fused_layers_sdpa_logits` (the default less
`sampled_head`: cuBLAS logits, then the compiled race), `fused_layers_sdpa_cublas_qkv` (the default less
`skinny_qkv`: q/k/v on cuBLAS), `fused_layers_sdpa_eager_ends` (the default with the step's work outside the
decoder layers run eagerly: embedding, RoPE, final norm, recording the sample, the counters; the other
compiled variants compile it), `fused_layers_sdpa_cache_write` (the default less `rope_attention`, and so
`skinny_qkv`: q's and k's RoPE and the cache writes compiled, before live attention),
`fused_layers_sdpa_cublas_head_mlp` (the default less all three), `fused_layers_sdpa_live` (live attention,
every projection and the head on cuBLAS),
`fused_layers_sdpa_masked` (none: SDPA over the whole masked cache, cuBLAS), `fused_layers_sdpa_autotune`
(Inductor times its own GEMM kernels against cuBLAS: mode max-autotune-no-cudagraphs); and of continuous
batching's tail: `fused_layers_sdpa_quarter` (the tail moves to a smaller pool once three quarters of it have
ended, not half: `shrink_ratio=4`), `fused_layers_sdpa_floor1` (down to a pool of one slot, not
`static.SHRINK_FLOOR`), `fused_layers_sdpa_no_ahead` (each pool captured when the tail moves into it, not while the
GPU runs the pool before), `fused_layers_sdpa_quarter_floor1_no_ahead` (all three: the default before them), and
`fused_layers_sdpa_no_shrink` (it never moves). `--timeline` splits each batch by
pool size: steps, time and ms a step, and the captures; the `engine.generate` lines are always split so.
On CUDA every variant that does not set `sdpa` uses SDPA, and with it the decode kernels (`gated_mlp` only where
the weights are fused). Without top-p (the bench specs' setting) every variant that does not turn `sampled_head` off samples with
it; the others form the logits and race them, compiled, or, in `fused_eager`, with the keyed noise computed
eagerly (about 30 elementwise kernels over [slots, vocabulary] a step, so that decode step is not the blocks'
cost alone).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from .profile_train import kernel_table, standalone_backend

FUSED_LAYERS_SDPA = {"fuse_weights": True, "compile_layers": True, "sdpa": True}  # the default on CUDA
VARIANTS = {
    "plain": {"fuse_weights": False},
    "fused": {"fuse_weights": True},
    "sdpa": {"fuse_weights": False, "sdpa": True},
    "fused_sdpa": {"fuse_weights": True, "sdpa": True},
    "fused_eager": {"fuse_weights": True, "compile_blocks": False},
    "fused_layers": {"fuse_weights": True, "compile_layers": True},
    "fused_layers_sdpa": FUSED_LAYERS_SDPA,
    "fused_layers_sdpa_autotune": {**FUSED_LAYERS_SDPA, "autotune": True},
    "fused_layers_sdpa_ungated": {**FUSED_LAYERS_SDPA, "gated_mlp": False},
    "fused_layers_sdpa_masked": {**FUSED_LAYERS_SDPA, "live_attention": False, "skinny": False, "gated_mlp": False,
                                 "sampled_head": False},
    "fused_layers_sdpa_live": {**FUSED_LAYERS_SDPA, "skinny": False, "gated_mlp": False, "sampled_head": False,
                               "rope_attention": False},
    "fused_layers_sdpa_logits": {**FUSED_LAYERS_SDPA, "sampled_head": False},
    "fused_layers_sdpa_eager_ends": {**FUSED_LAYERS_SDPA, "compile_ends": False},
    "fused_layers_sdpa_cublas_qkv": {**FUSED_LAYERS_SDPA, "skinny_qkv": False},
    "fused_layers_sdpa_cache_write": {**FUSED_LAYERS_SDPA, "rope_attention": False},
    "fused_layers_sdpa_cublas_head_mlp": {**FUSED_LAYERS_SDPA, "gated_mlp": False, "sampled_head": False,
                                          "rope_attention": False},
    "fused_layers_sdpa_quarter": {**FUSED_LAYERS_SDPA, "shrink_ratio": 4},
    "fused_layers_sdpa_floor1": {**FUSED_LAYERS_SDPA, "shrink_floor": 1},
    "fused_layers_sdpa_no_ahead": {**FUSED_LAYERS_SDPA, "capture_ahead": False},
    "fused_layers_sdpa_quarter_floor1_no_ahead": {**FUSED_LAYERS_SDPA, "shrink_ratio": 4, "shrink_floor": 1,
                                                  "capture_ahead": False},
    "fused_layers_sdpa_no_shrink": {**FUSED_LAYERS_SDPA, "shrink_tail": False},
}


def timeline_summary(timeline: list[tuple]) -> str:
    """A `GraphSampler.timeline` as one line per pool size: decode steps, their seconds and ms a step (host checks,
    refills and copies out included, and the host's captures ahead beside them), then the graph captures."""
    lines, captures = [], [t for t in timeline if t[0] == "capture"]
    for slots in sorted({t[1] for t in timeline if t[0] == "decode"}, reverse=True):
        parts = [t for t in timeline if t[0] == "decode" and t[1] == slots]
        steps, seconds = sum(t[2] for t in parts), sum(t[3] for t in parts)
        lines.append(f"  {slots:5d} slots: {steps:5d} steps, {seconds:.3f} s, {seconds / steps * 1e3:.3f} ms a step")
    ahead = [t for t in captures if t[3]]
    lines.append(f"  captures: {len(captures)} ({', '.join(str(t[1]) for t in captures)} slots), "
                 f"{sum(t[2] for t in captures) * 1e3:.1f} ms, of which {len(ahead)} ahead "
                 f"({sum(t[2] for t in ahead) * 1e3:.1f} ms of host time beside the decode steps)")
    return "\n".join(lines)


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def _slots(spec) -> int | None:
    return spec.decode_slots if spec.continuous_batching else None


def _load(sampler, state, input_ids, attention_mask) -> None:
    """Prefill the batch's prompts and start its first samples in every slot of the pool."""
    from ..rollout.noise import sample_keys

    prompts = sampler._prefill(input_ids, attention_mask)
    keys = sample_keys(1, torch.arange(input_ids.shape[0], device=sampler.device))
    sampler._start(state, prompts, keys, list(range(min(state.done.shape[0], input_ids.shape[0]))), 0)


def _lengths(rollout) -> str:
    lengths = torch.tensor([len(c) for c in rollout.completion_ids], dtype=torch.float)
    p50, p90 = torch.quantile(lengths, torch.tensor([0.5, 0.9])).tolist()
    return f"lengths mean {lengths.mean():.1f}, p50 {p50:.0f}, p90 {p90:.0f}, max {lengths.max():.0f}"


@torch.no_grad()
def _split(sampler, input_ids, attention_mask, spec, eos: int, replays: int) -> dict[str, float]:
    """Prefill, capture and per-step decode time of the spec's pool (the sampler's internals, timed apart)."""
    from ..rollout.static import graph_key

    width = input_ids.shape[1]
    key = graph_key(sampler.pool_shape(input_ids.shape, _slots(spec)), spec.max_new_tokens, spec.temperature,
                    spec.top_p, eos)
    bucket, length = key[:2]
    with torch.cuda.device(sampler.device):
        if sampler.fuse:
            sampler.decoder.fuse_weights()
        sampler._states.pop(key, None)
        capture = _timed(lambda: sampler._state(key), 1)[0]  # warmed shape: capture only
        state = sampler._states[key]
        prefill = statistics.median(_timed(lambda: _load(sampler, state, input_ids, attention_mask), 3))
        replays = min(replays, spec.max_new_tokens)

        def decode():
            _load(sampler, state, input_ids, attention_mask)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(replays):
                state.graph.replay()
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / replays

        step = statistics.median(decode() for _ in range(3))
    return {"prefill_ms": prefill * 1e3, "capture_ms": capture * 1e3, "decode_step_ms": step * 1e3,
            "bucket": bucket, "cache_len": length, "prompt_width": width}


@torch.no_grad()
def _kernels(sampler, input_ids, attention_mask, spec, eos: int, rows: int) -> str:
    """Kernel tables of the decode step: graph replays, then the same step run eagerly."""
    state = next(iter(sampler._states.values()))
    out = []
    with torch.cuda.device(sampler.device):
        _load(sampler, state, input_ids, attention_mask)
        for title, run in (("graph replays", state.graph.replay),
                           ("eager step (same step outside the graph)",
                            lambda: sampler._step(state, spec.temperature, spec.top_p, eos))):
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(8):
                    run()
                torch.cuda.synchronize()
            out.append(f"--- {title}, 8 steps ---\n" + kernel_table(prof, rows, 60))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlspec.perf.profile_engine", description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per setting (median reported)")
    parser.add_argument("--variants", default="plain,fused,fused_sdpa,fused_layers,fused_layers_sdpa")
    parser.add_argument("--replays", type=int, default=64, help="graph replays timed for the per-step figure")
    parser.add_argument("--rows", type=int, default=30, help="kernels to list (0: no kernel tables)")
    parser.add_argument("--timeline", action="store_true",
                        help="each variant's batch again, split by pool size (steps, time, captures)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_engine needs a CUDA device")

    from ..rollout.static import GraphSampler

    plan, task, backend = standalone_backend(args.spec, args.overrides)
    spec = plan.spec.rollout
    try:
        engine = backend.rollout_engine()
        prompts = [p.text for p in task.sample(0, plan.batch.prompts_per_step)]
        group = plan.spec.algorithm.group_size
        eos = engine.tokenizer.eos_token_id
        model = engine.model.eval()
        _, input_ids, attention_mask = engine.encode(prompts, group)
        print(f"{torch.cuda.get_device_name(0)}: {input_ids.shape[0]} rows x {spec.max_new_tokens} new tokens, "
              f"prompt width {input_ids.shape[1]}, top_p {spec.top_p}, temperature {spec.temperature}")

        for flipped in (False, True):
            view = engine.with_spec(replace(spec, continuous_batching=spec.continuous_batching != flipped))
            view.generate(prompts, group, seed=0)  # compile and warm up
            gen = _timed(lambda: view.generate(prompts, group, seed=1), args.repeats)
            mode = f"continuous, {spec.decode_slots} slots" if view.spec.continuous_batching else "static batch"
            sampler = view._fast_sampler()
            sampler.timeline = []
            began = time.perf_counter()
            lengths = _lengths(view.generate(prompts, group, seed=1))
            whole = time.perf_counter() - began
            batch = sum(t[1] for t in sampler.timeline if t[0] == "batch")
            print(f"engine.generate ({mode}): median {statistics.median(gen):.3f} s "
                  f"({', '.join(f'{t:.3f}' for t in gen)}); {lengths}; in the split call {whole:.3f} s, of which "
                  f"{batch:.3f} s the sampler's batch")
            print(timeline_summary(sampler.timeline))
            sampler.timeline = None

        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=engine.device)
        dst = torch.empty_like(src)
        copy_s = statistics.median(_timed(lambda: dst.copy_(src), 5))
        del src, dst
        bandwidth = 2 * nbytes / copy_s  # a copy reads and writes
        print(f"weights {nbytes / 1e9:.2f} GB; copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
              f"weight-read floor of a decode step {nbytes / bandwidth * 1e3:.3f} ms")

        first = None
        print(f"{'variant':12} {'batch s':>8} {'prefill ms':>10} {'capture ms':>10} {'decode ms/step':>14}")
        for name in args.variants.split(","):
            sampler = GraphSampler(model, engine.device, keep_graphs=False, **VARIANTS[name])

            def batch(seed=1, sampler=sampler):
                sampler.sample(input_ids, attention_mask, seed, spec.max_new_tokens, spec.temperature, spec.top_p, eos,
                               _slots(spec))

            try:
                batch(0)  # compile, warm up
                wall = statistics.median(_timed(batch, args.repeats))
                timeline = ""
                if args.timeline:
                    sampler.timeline = []
                    batch()
                    timeline, sampler.timeline = timeline_summary(sampler.timeline), None
                sampler.keep_graphs = True
                parts = _split(sampler, input_ids, attention_mask, spec, eos, args.replays)
            except Exception as err:  # noqa: BLE001 - one variant failing must not hide the others' figures
                print(f"{name:12} failed: {type(err).__name__}: {err}")
                continue
            print(f"{name:12} {wall:8.3f} {parts['prefill_ms']:10.2f} {parts['capture_ms']:10.1f} "
                  f"{parts['decode_step_ms']:14.3f}   (slots {parts['bucket']}, cache {parts['cache_len']})")
            if timeline:
                print(timeline)
            if first is None:
                first = sampler
            else:
                sampler._states.clear()
                sampler.decoder.unfuse_weights()
        if first is not None and args.rows > 0:
            print(_kernels(first, input_ids, attention_mask, spec, eos, args.rows))
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
