"""The CUDA-graph engine path's logic, run eagerly on CPU: its forward, cache, sampling and log-probs."""

from __future__ import annotations

import pytest
import torch

from rlspec.models.base import byte_tokenizer
from rlspec.models.factory import load_model
from rlspec.core.policy import batch_logprobs
from rlspec.rollout.base import collate, engine_logprobs_tensor
from rlspec.rollout.hf import HFEngine
from rlspec.rollout.noise import keyed_exponential, open_uniform, sample_keys
from rlspec.rollout.decoder import StaticDecoder, unsupported_reason
from rlspec.core.grpo import vocab_splits
from rlspec.rollout.sampling import exponential_race, sample_from_logits
from rlspec.rollout.static import GraphSampler
from rlspec.spec import ModelSpec, RolloutSpec


@pytest.fixture(scope="module")
def model():
    return load_model(ModelSpec(), seed=0).eval()


def _engine(model, **rollout) -> HFEngine:
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(**rollout), "cpu")
    sampler = GraphSampler(model, "cpu", use_graphs=False, check_every=4)
    engine._fast_sampler = lambda: sampler  # the CUDA path's code, without graphs, on CPU
    return engine


def test_decoder_matches_hf_forward_with_left_padding(model):
    decoder = StaticDecoder(model)
    ids = torch.tensor([[0, 0, 101, 65, 70], [102, 103, 104, 65, 71]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = mask.cumsum(-1).sub(1).clamp(min=0)
    keys, values = decoder.new_cache(2, 8, "cpu")
    valid = torch.zeros(2, 8, dtype=torch.bool)
    valid[:, :4] = mask[:, :4].bool()
    allowed = torch.ones(4, 8, dtype=torch.bool).tril() & valid[:, None, :]
    with torch.no_grad():
        decoder.forward(ids[:, :4], positions[:, :4], torch.arange(4), allowed, keys, values)
        valid[:, 4] = True  # one decode step on top of the cached prefix
        last = decoder.forward(ids[:, 4:], positions[:, 4:], torch.tensor([4]), valid[:, None, :], keys, values)
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
    assert (last - expected).abs().max().item() < 1e-5


def check_logprobs_match_trainer(engine: HFEngine, model):
    """The engine's sampled log-probs (12 tokens, temperature 0.7, top-p 0.9) equal the trainer's within 1e-5, and the
    same seed samples the same tokens; returns the rollout."""
    rollout = engine.generate(["a=", "bcd=", "hello="], n=3, seed=1)
    batch = collate(rollout, torch.zeros(9), torch.zeros(9), engine.tokenizer.pad_token_id)
    trainer = batch_logprobs(model, batch, temperature=0.7, micro_batch_size=4, device="cpu")
    diff = ((trainer - engine_logprobs_tensor(rollout, batch)) * batch.loss_mask).abs().max().item()
    assert diff < 1e-5, diff
    assert engine.generate(["a=", "bcd=", "hello="], n=3, seed=1).completion_ids == rollout.completion_ids
    return rollout


def test_graph_path_logprobs_match_trainer_and_are_reproducible(model):
    engine = _engine(model, max_new_tokens=12, temperature=0.7, top_p=0.9)
    rollout = check_logprobs_match_trainer(engine, model)
    eos = engine.tokenizer.eos_token_id
    for ids in rollout.completion_ids:
        assert 1 <= len(ids) <= 12 and eos not in ids[:-1]
    assert engine.generate(["a=", "bcd=", "hello="], n=3, seed=2).completion_ids != rollout.completion_ids


def test_sampling_follows_a_known_categorical():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    draws = 20000
    logits = probs.log().expand(draws, -1)
    keys, steps = sample_keys(0, torch.arange(draws)), torch.zeros(draws, dtype=torch.long)
    token, logp = sample_from_logits(logits, 1.0, 1.0, keys, steps)
    assert torch.allclose(logp.exp(), probs[token], atol=1e-6)
    counts = torch.bincount(token, minlength=5).float()
    chi2 = (((counts - draws * probs) ** 2) / (draws * probs)).sum().item()
    assert chi2 < 20.5, chi2  # chi-square, 4 degrees of freedom: P(> 20.5) < 4e-4
    top, _ = sample_from_logits(logits, 1.0, 0.7, keys, steps)
    assert set(top.tolist()) <= {0, 1}, "top-p 0.7 keeps the tokens whose mass reaches 0.7"


def test_race_reduced_in_parts_picks_the_whole_row_argmax():
    """The race over a vocabulary split into parts (4,096: 4 parts) picks the token of one argmax over the whole
    row, and its log-prob is the log_softmax's, at two temperatures; peaked rows put the winners in every part."""
    torch.manual_seed(0)
    vocab = 4096
    assert vocab_splits(vocab) == 4
    logits = (torch.randn(256, vocab) * 4).bfloat16()
    keys, steps = sample_keys(5, torch.arange(256)), torch.arange(256)
    for temperature in (1.0, 0.6):
        token, logp = exponential_race(logits, keys, steps, temperature)
        scaled = logits.float() / temperature
        expected = torch.argmax(scaled - keyed_exponential(keys, steps, vocab).log(), dim=-1)
        assert torch.equal(token, expected)
        assert len(set((token // (vocab // 4)).tolist())) == 4
        full = torch.log_softmax(scaled, dim=-1).gather(-1, token[:, None]).squeeze(-1)
        assert torch.allclose(logp, full, atol=1e-5)


def test_keyed_noise_is_exponential_and_never_zero():
    """The uniform behind the race noise stays inside (0, 1) at the extreme hashes (an exponential of 0 would win
    the race whatever its token's probability), and the noise has the Exp(1) mean and variance."""
    extremes = open_uniform(torch.tensor([0, 1, 2**32 - 2, 2**32 - 1]))
    assert bool((extremes > 0).all() and (extremes < 1).all())
    noise = keyed_exponential(sample_keys(3, torch.arange(64)), torch.arange(64), 4096)
    assert abs(noise.mean().item() - 1) < 0.01 and abs(noise.var().item() - 1) < 0.03
    other = keyed_exponential(sample_keys(3, torch.arange(64)), torch.arange(64) + 1, 4096)
    assert abs(torch.corrcoef(torch.stack([noise.flatten(), other.flatten()]))[0, 1].item()) < 0.01


def test_unsupported_models_are_named():
    assert unsupported_reason(load_model(ModelSpec(), seed=0)) is None
    assert "model_type" in unsupported_reason(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("fuse, sdpa", [(True, False), (False, True), (True, True)])
def test_fused_weights_and_sdpa_give_the_same_samples(model, fuse, sdpa):
    """The fused q/k/v and gate/up matrices and the SDPA attention are the same forward: the same seed samples
    the same tokens with the same log-probs as the plain blocks, and a weight change reaches the fused copies."""
    def run(sampler):
        engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=10, temperature=0.8), "cpu")
        engine._fast_sampler = lambda: sampler
        return engine.generate(["a=", "bcd=", "hello="], n=2, seed=3)

    def assert_same(a, b):
        assert a.completion_ids == b.completion_ids
        diff = max(abs(x - y) for u, v in zip(a.completion_logprobs, b.completion_logprobs) for x, y in zip(u, v))
        assert diff < 1e-5, diff

    fast = GraphSampler(model, "cpu", use_graphs=False, check_every=4, fuse_weights=fuse, sdpa=sdpa, keep_graphs=True)
    assert_same(run(fast), run(GraphSampler(model, "cpu", use_graphs=False, check_every=4)))
    if fuse:  # the fused copies follow an in-place change of the module's weights (an optimizer step, a sync)
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.5)
            assert_same(run(fast), run(GraphSampler(model, "cpu", use_graphs=False)))
        finally:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(saved[n])


def check_compiled_samples_like_plain(model, **compiled) -> None:
    """The CUDA path's compiled decode step (`GraphSampler` with fused weights and compiled blocks, plus `compiled`),
    run on CPU without graphs, samples the plain blocks' tokens, and their log-probs within 1e-5."""
    def run(sampler):
        engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=10, temperature=0.8), "cpu")
        engine._fast_sampler = lambda: sampler
        return engine.generate(["a=", "bcd=", "hello="], n=2, seed=3)

    plain = run(GraphSampler(model, "cpu", use_graphs=False))
    fast = run(GraphSampler(model, "cpu", use_graphs=False, compile_blocks=True, fuse_weights=True, **compiled))
    assert fast.completion_ids == plain.completion_ids
    diff = max(abs(a - b) for x, y in zip(fast.completion_logprobs, plain.completion_logprobs) for a, b in zip(x, y))
    assert diff < 1e-5, diff


@pytest.mark.slow
@pytest.mark.parametrize("layers", [True, False])
def test_compiled_decoder_samples_like_the_plain_one(model, layers):
    """The torch.compile'd decode step (per layer, or per block) that the CUDA path uses, run on CPU without
    graphs: the same tokens and log-probs as the plain blocks. Slow (Inductor compiles for about 30 s)."""
    check_compiled_samples_like_plain(model, compile_layers=layers)


@pytest.mark.parametrize("seed", [0, 7, 2**31 - 1, 2**40 + 3])
def test_the_servers_python_keys_are_the_tensor_keys(seed):
    """`sample_key_list` (the server's requests) gives the keys `sample_keys` gives the engine's batches."""
    from rlspec.rollout.noise import sample_key_list

    assert sample_key_list(seed, 5, 300) == sample_keys(seed, torch.arange(5, 305)).tolist()
