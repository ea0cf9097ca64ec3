"""GPU-only (skipped without CUDA): the CUDA-graph engine on each model type it runs, in bf16 at a published shape
(Qwen3 0.6B, Gemma 3 1B) and tiny Gemma 2 (soft-capped scores and logits): the graph path is taken, its log-probs
are the trainer's, its samples reproducible per seed, its greedy tokens transformers' `generate`'s (up to bf16 near
ties; `rlspec.perf.bench_models` says how that is measured)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["qwen3_0p6b_shape", "gemma3_1b_shape", "tiny_gemma2"])
def test_graph_engine_per_model_type(preset):
    from rlspec.models.base import byte_tokenizer
    from rlspec.perf.bench_models import GREEDY_GAP_MAX, MULT_PROB_ERROR_MAX, build, greedy_gaps, mult_prob_error
    from rlspec.rollout.hf import HFEngine
    from rlspec.spec import RolloutSpec

    model = build(preset)
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=64, temperature=0.9), "cuda")
    assert engine.sampler_kind() == "cuda_graph"
    prompts = ["a=", "bcd=", "hello world=", "x" * 20 + "=", "7 plus 22 is", "q", "the end", "0123456789"]
    rollout = engine.generate(prompts, n=4, seed=0)
    assert engine.generate(prompts, n=4, seed=0).completion_ids == rollout.completion_ids, "reproducible per seed"
    assert engine.generate(prompts, n=4, seed=1).completion_ids != rollout.completion_ids
    error, worst = mult_prob_error(model, rollout, 0.9)
    gaps = greedy_gaps(engine, prompts, 32)
    print(f"{preset}: token_mult_prob_error {error:.5f} (max |diff| {worst:.3e}); greedy rows identical to generate's "
          f"{sum(g == 0 for g in gaps)}/{len(gaps)}, first-difference logit gaps {[round(g, 4) for g in gaps if g]}")
    assert error <= MULT_PROB_ERROR_MAX
    assert max(gaps) <= GREEDY_GAP_MAX, gaps
    assert sum(g == 0 for g in gaps) >= len(gaps) // 2


def test_llama3_rope_scaling_on_cuda_matches_transformers():
    """Llama 3's RoPE scaling through the compiled decode step (fp32 tiny model): log-probs the trainer's."""
    from rlspec.models.base import byte_tokenizer
    from rlspec.perf.bench_models import build, mult_prob_error
    from rlspec.rollout.hf import HFEngine
    from rlspec.spec import RolloutSpec

    model = build("tiny_llama3", dtype=torch.float32)
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=96), "cuda")
    assert engine.sampler_kind() == "cuda_graph"
    rollout = engine.generate(["a=", "bcd=", "hello="], n=4, seed=0)
    _, worst = mult_prob_error(model, rollout, 1.0)
    assert worst < 1e-3, worst
