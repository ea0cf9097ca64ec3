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
    from rlspec.perf.bench_models import (GREEDY_GAP_MAX, build, error_bound, greedy_gaps, mult_prob_error,
                                          reference_errors)
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
    references = reference_errors(model, rollout, 0.9)
    print(f"{preset}: token_mult_prob_error {error:.5f} (max |diff| {worst:.3e}); greedy rows identical to generate's "
          f"{sum(g == 0 for g in gaps)}/{len(gaps)}, first-difference logit gaps {[round(g, 4) for g in gaps if g]}; "
          f"{references}")
    # As near the trainer as transformers' own cached decode of the same samples (bench_models.MULT_PROB_ERROR_MAX),
    # and no farther from the fp32 forward than the bf16 trainer is
    assert error <= error_bound(references["hf_cached_error"])
    assert references["engine_vs_fp32"] <= references["trainer_vs_fp32"] + 0.002
    assert max(gaps) <= GREEDY_GAP_MAX, gaps  # random weights: near ties are common, so rows may part at one


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


def test_free_during_train_hands_the_cache_and_the_weights_back():
    """An engine alone in its process (`own_process`, as a Ray engine actor): after a rollout `kv_cache` leaves the
    device at least the K/V cache's bytes fewer reserved than `none`, `kv_cache_and_weights` the weights' bytes fewer
    again, and a push of the same weights samples the same tokens."""
    from rlspec.models.base import byte_tokenizer
    from rlspec.perf.bench_models import build
    from rlspec.rollout.hf import HFEngine
    from rlspec.rollout.static import CACHE_STEP
    from rlspec.spec import RolloutSpec

    model = build("qwen3_0p6b_shape")
    saved = {name: t.cpu() for name, t in model.state_dict().items()}  # off the device: no block shares its segments
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=200), "cuda", own_process=True)
    prompts = [f"{i} plus {i}=" for i in range(16)]

    def reserved_after(setting: str):
        engine.free_during_train = setting
        rollout = engine.generate(prompts, n=8, seed=0)
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved(), rollout

    held, first = reserved_after("none")
    freed, _ = reserved_after("kv_cache")
    config = model.config
    length = -(-(max(len(p) for p in prompts) + 200) // CACHE_STEP) * CACHE_STEP
    kv_bytes = 128 * length * config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2
    weight_bytes = sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.parameters()}.values())
    gone, _ = reserved_after("kv_cache_and_weights")
    print(f"reserved after a rollout: none {held / 2**30:.2f} GB, kv_cache {freed / 2**30:.2f} GB, "
          f"kv_cache_and_weights {gone / 2**30:.2f} GB; K/V cache {kv_bytes / 2**30:.2f} GB, weights {weight_bytes / 2**30:.2f} GB")
    assert held - freed >= kv_bytes
    assert freed - gone >= 0.95 * weight_bytes
    engine.load_weights(saved.items())
    engine.free_during_train = "none"
    assert engine.generate(prompts, n=8, seed=0).completion_ids == first.completion_ids
