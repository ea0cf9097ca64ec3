"""Continuous batching and shared group prefill in the CUDA-graph sampler, run eagerly on CPU: every sample gets
the same tokens and log-probs as in the static batch (the noise is keyed by seed, sample and position), and
the log-probs equal the trainer's."""

from __future__ import annotations

import pytest
import torch

from rlspec.core.policy import batch_logprobs
from rlspec.errors import SpecError
from rlspec.models.base import byte_tokenizer
from rlspec.models.factory import load_model
from rlspec.rollout.base import collate, engine_logprobs_tensor
from rlspec.rollout.hf import HFEngine
from rlspec.rollout.static import GraphSampler, bucket_for
from rlspec.spec import ModelSpec, RolloutSpec

PROMPTS = ["a=", "bcd=", "hello="]
HAZARD = 0.12


@pytest.fixture(scope="module")
def model():
    return load_model(ModelSpec(eos_hazard=HAZARD), seed=0).eval()


def _generate(model, sampler: GraphSampler, n: int = 4, **rollout):
    spec = RolloutSpec(**{"max_new_tokens": 24, "temperature": 1.0, **rollout})
    engine = HFEngine(model, byte_tokenizer(), spec, "cpu")
    engine._fast_sampler = lambda: sampler  # the CUDA path's code, without graphs, on CPU
    return engine, engine.generate(PROMPTS, n=n, seed=5)


def _max_logp_diff(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a.completion_logprobs, b.completion_logprobs) for x, y in zip(u, v))


def test_eos_hazard_sets_the_end_tokens_probability_at_every_step(model):
    ids = torch.randint(4, 250, (4, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids).logits.float(), dim=-1)
    eos = model.config.eos_token_id
    assert (probs[..., eos] - HAZARD).abs().max().item() < 1e-4
    with pytest.raises(SpecError, match="model.eos_hazard"):
        ModelSpec(path="/some/dir", eos_hazard=0.1)
    with pytest.raises(SpecError, match="model.eos_hazard"):
        ModelSpec(eos_hazard=1.0)


@pytest.mark.parametrize("slots, ratio, floor", [(2, 4, 1), (5, 4, 1), (5, 2, 1), (5, 2, 4)])
def test_refilled_slots_sample_what_the_static_batch_samples(model, slots, ratio, floor):
    """12 samples through 2 (or 8: 5 rounded up to the bucket) slots, refilled as samples end (the 8-slot pool's
    tail moved into a smaller pool, of at least `floor` slots, once a quarter, or half, of it is live), against the
    static batch of 12 rows: the same tokens per sample, log-probs within fp32 rounding, equal to the trainer's."""
    check = 3
    static_engine, static = _generate(model, GraphSampler(model, "cpu", use_graphs=False, check_every=check),
                                      continuous_batching=False)
    sampler = GraphSampler(model, "cpu", use_graphs=False, check_every=check, shrink_ratio=ratio, shrink_floor=floor)
    shrunk, held = [], []

    def shrink(state, live, *args, move=sampler._shrink):
        shrunk.append(len(live))
        small = move(state, live, *args)
        held.append(len(sampler._states))
        return small

    sampler._shrink = shrink
    sampler.timeline = []
    engine, rolled = _generate(model, sampler, decode_slots=slots)
    stretches = [t for t in sampler.timeline if t[0] == "decode"]
    assert sum(t[2] for t in stretches) >= max(len(c) for c in rolled.completion_ids)  # every step is on record
    assert [t[1] for t in stretches] == sorted((t[1] for t in stretches), reverse=True)  # pools only ever shrink
    pools = {bucket_for(max(live, floor)) for live in shrunk}
    assert {t[1] for t in stretches} == {8 if slots == 5 else 2, *pools}
    assert bool(shrunk) == (slots == 5), shrunk
    assert all(live * ratio <= 8 for live in shrunk) and (ratio == 4 or floor > 2 or len(shrunk) >= 2), shrunk
    assert min(t[1] for t in stretches) >= min(floor, 2 if slots == 2 else 8), "no pool below the floor"
    assert floor == 1 or len(shrunk) == 1, shrunk  # 8 -> 4, and no further
    assert held == [1] * len(shrunk), held  # the pool the tail left is dropped at the move
    lengths = [len(c) for c in rolled.completion_ids]
    assert min(lengths) < 24 // 2 and len(set(lengths)) > 3, f"the workload must end samples early: {lengths}"
    assert rolled.completion_ids == static.completion_ids
    assert _max_logp_diff(rolled, static) < 1e-5
    eos = engine.tokenizer.eos_token_id
    for ids in rolled.completion_ids:
        assert 1 <= len(ids) <= 24 and eos not in ids[:-1] and (ids[-1] == eos or len(ids) == 24)
    batch = collate(rolled, torch.zeros(12), torch.zeros(12), engine.tokenizer.pad_token_id)
    trainer = batch_logprobs(model, batch, temperature=1.0, micro_batch_size=4, device="cpu")
    assert ((trainer - engine_logprobs_tensor(rolled, batch)) * batch.loss_mask).abs().max().item() < 1e-5
    _, again = _generate(model, GraphSampler(model, "cpu", use_graphs=False, check_every=check), decode_slots=slots)
    assert again.completion_ids == rolled.completion_ids


def test_static_batch_in_waves_samples_what_one_wave_samples(model):
    """More rows than the pool without continuous batching: waves of whole pools, the same samples."""
    sampler = GraphSampler(model, "cpu", use_graphs=False, check_every=4)
    prompt = byte_tokenizer()("ab=", add_special_tokens=False).input_ids
    ids = torch.tensor([prompt] * 6)
    mask = torch.ones_like(ids)
    one = sampler.sample(ids, mask, 3, 16, 1.0, 1.0, 2)
    sampler.pool_shape = lambda shape, slots: (2, shape[1])  # a pool of 2 slots: three waves
    waves = sampler.sample(ids, mask, 3, 16, 1.0, 1.0, 2)
    assert torch.equal(one[0], waves[0]) and torch.allclose(one[1], waves[1], atol=1e-5)


def test_one_prefill_per_group_samples_what_separate_prefills_sample(model):
    """The G completions of a prompt copy its one prefilled K/V: the same tokens and log-probs as G prefills."""
    calls = []
    shared = GraphSampler(model, "cpu", use_graphs=False, check_every=4)
    forward = shared.decoder.forward
    shared.decoder.forward = lambda ids, *a, **k: calls.append(ids.shape) or forward(ids, *a, **k)
    _, a = _generate(model, shared, top_p=0.9)
    prefills = [shape for shape in calls if shape[1] > 1]
    assert sum(shape[0] for shape in prefills) == len(PROMPTS), f"one prefilled row per prompt: {prefills}"
    _, b = _generate(model, GraphSampler(model, "cpu", use_graphs=False, check_every=4, share_prefill=False), top_p=0.9)
    assert a.completion_ids == b.completion_ids
    assert _max_logp_diff(a, b) < 1e-5


def test_int32_noise_hash_is_the_int64_hash_bit_for_bit():
    """The [B, V] noise is hashed in int32 (wrapping products, masked shifts) for speed; its bits must be the
    32-bit hash `_mix32` defines in int64, or the sampler's draws would change with the arithmetic."""
    from rlspec.rollout import noise

    values = torch.arange(-2**31, 2**31, 2**31 // 50_000 * 3 + 1, dtype=torch.int64)
    ints = noise._as_int32(values & noise._MASK32)
    want = noise._mix32(noise._mix32(values & noise._MASK32) ^ 0x9E3779B9)
    got = noise._mix32_int32(noise._mix32_int32(ints) ^ noise._as_int32(torch.tensor(0x9E3779B9)))
    assert got.dtype == torch.int32 and torch.equal(got.long() & noise._MASK32, want)
    assert torch.equal(noise.open_uniform(got), noise.open_uniform(want))
