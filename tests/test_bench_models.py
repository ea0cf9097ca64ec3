"""`rlspec.perf.bench_models` on CPU: transformers' KV-cached decode (the reference for the engine's log-prob error)
gives the engine's log-probs on a tiny fp32 model, and the pass bound follows it."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("preset", ["tiny_qwen3", "tiny_gemma3"])
def test_cached_decode_matches_the_engine_and_the_trainer_in_fp32(preset):
    from rlspec.models.base import byte_tokenizer
    from rlspec.perf.bench_models import build, cached_decode_logprobs, reference_errors
    from rlspec.rollout.hf import HFEngine
    from rlspec.spec import RolloutSpec

    model = build(preset, "cpu", torch.float32)
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=12, temperature=0.8), "cpu")
    rollout = engine.generate(["a=", "hello there=", "xyz"], n=2, seed=0)  # prompts of three widths: left padding
    cached = cached_decode_logprobs(model, rollout, 0.8)
    assert [len(c) for c in cached] == [len(c) for c in rollout.completion_ids]
    for ours, theirs in zip(cached, rollout.completion_logprobs):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)
    errors = reference_errors(model, rollout, 0.8)
    assert set(errors) == {"hf_cached_error", "engine_vs_fp32", "trainer_vs_fp32", "hf_cached_vs_fp32"}
    assert all(1.0 <= value < 1.0001 for value in errors.values()), errors


def test_the_error_bound_is_the_fixed_one_or_the_cached_decodes_plus_slack():
    from rlspec.perf.bench_models import CACHED_DECODE_SLACK, MULT_PROB_ERROR_MAX, check, error_bound

    assert error_bound(None) == MULT_PROB_ERROR_MAX == error_bound(1.001)
    assert error_bound(1.0219) == pytest.approx(1.0219 + CACHED_DECODE_SLACK)
    line = {"sampler": "cuda_graph", "token_mult_prob_error": 1.02446, "greedy_max_gap": 0.03}
    assert not check(line)  # no reference measured: the fixed bound
    assert check(line | {"hf_cached_error": 1.0219})
    assert not check(line | {"hf_cached_error": 1.0150})
    assert not check(line | {"hf_cached_error": 1.0219, "sampler": "hf"})
