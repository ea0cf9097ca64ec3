"""The hf engine: group layout, end-of-sequence handling, and its log-probs versus the trainer's."""

from __future__ import annotations

import pytest
import torch

from rlspec.core.batch import TrainBatch
from rlspec.models.base import byte_tokenizer
from rlspec.models.factory import load_model
from rlspec.core.policy import batch_logprobs
from rlspec.rollout.base import collate, engine_logprobs_tensor
from rlspec.rollout.hf import HFEngine
from rlspec.spec import ModelSpec, RolloutSpec


@pytest.fixture(scope="module")
def engine():
    return HFEngine(load_model(ModelSpec(), seed=0), byte_tokenizer(), RolloutSpec(max_new_tokens=12, temperature=0.8), "cpu")


def test_groups_lengths_and_reproducibility(engine):
    rollout = engine.generate(["a=", "bcd="], n=3, seed=5)
    assert len(rollout.completion_ids) == 6
    assert rollout.prompt_ids[:3] == [[101, 65]] * 3 and rollout.prompt_ids[3] == [102, 103, 104, 65]
    eos = engine.tokenizer.eos_token_id
    for ids, logps in zip(rollout.completion_ids, rollout.completion_logprobs):
        assert 1 <= len(ids) <= 12 and len(logps) == len(ids)
        assert eos not in ids[:-1], "nothing is kept after the first end-of-sequence token"
        assert all(lp <= 0 for lp in logps)
    assert engine.generate(["a=", "bcd="], n=3, seed=5).completion_ids == rollout.completion_ids
    assert engine.generate(["a=", "bcd="], n=3, seed=6).completion_ids != rollout.completion_ids


def test_engine_logprobs_match_trainer_forward(engine):
    """Left-padded sampling and right-padded training give the same token log-probs."""
    rollout = engine.generate(["a=", "bcd=", "hello="], n=2, seed=1)
    batch = collate(rollout, torch.zeros(6), torch.zeros(6), engine.tokenizer.pad_token_id)
    trainer = batch_logprobs(engine.model, batch, temperature=0.8, micro_batch_size=4, device="cpu")
    diff = ((trainer - engine_logprobs_tensor(rollout, batch)) * batch.loss_mask).abs().max().item()
    assert diff < 1e-5, diff


def test_collate_masks():
    from rlspec.rollout.base import Rollout

    rollout = Rollout([[5, 6], [7]], [[8, 2], [9, 10, 11]], [[-1.0, -2.0], [-1.0, -1.0, -1.0]], ["", ""])
    batch: TrainBatch = collate(rollout, torch.tensor([1.0, -1.0]), torch.tensor([1.0, 0.0]), pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 8, 2], [7, 9, 10, 11]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    trimmed = collate(Rollout([[5]], [[6]], [[-1.0]], [""]), torch.zeros(1), torch.zeros(1), 0)
    assert trimmed.input_ids.shape == (1, 2)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    from rlspec.rollout.sampling import top_p_filter

    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1]])
    assert torch.equal(top_p_filter(probs, 0.7), torch.tensor([[0.0, 0.5, 0.3, 0.0]]))
    assert torch.equal(top_p_filter(probs, 0.4), torch.tensor([[0.0, 0.5, 0.0, 0.0]]))  # the top token always stays
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_sampling_follows_the_model_distribution():
    """With temperature 1 and top-p 1, first-token frequencies match the model's softmax."""
    model = load_model(ModelSpec(), seed=0)
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=1), "cpu")
    rollout = engine.generate(["a="], n=4000, seed=0)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([[101, 65]])).logits[0, -1], -1)
    counts = torch.bincount(torch.tensor([c[0] for c in rollout.completion_ids]), minlength=probs.numel()).float()
    top = probs.argsort(descending=True)[:5]
    assert torch.allclose(counts[top] / 4000, probs[top], atol=0.02)


def test_a_split_step_samples_what_one_call_samples(engine):
    """Sample i draws noise keyed by (seed, first_sample + i): the halves of a step sent to two engines, each with
    its first sample's index, get the tokens of the whole step in one call (several rollout servers rely on it)."""
    prompts, n = ["a=", "bcd=", "hello=", "xy="], 3
    whole = engine.generate(prompts, n=n, seed=7)
    first = engine.generate(prompts[:1], n=n, seed=7)
    rest = engine.generate(prompts[1:], n=n, seed=7, first_sample=n)
    assert first.completion_ids + rest.completion_ids == whole.completion_ids
    for a, b in zip(first.completion_logprobs + rest.completion_logprobs, whole.completion_logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    shifted = engine.generate(prompts[1:], n=n, seed=7)
    assert shifted.completion_ids != rest.completion_ids, "the offset must change the noise"


def test_the_slot_pool_numbers_a_split_step_the_same_way():
    """The CUDA-graph sampler's code (eager, on CPU): halves sent with their first sample's index get the whole
    step's tokens, as in the plain loop above."""
    from rlspec.rollout.static import GraphSampler

    model = load_model(ModelSpec(eos_hazard=0.12), seed=0).eval()
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=16, decode_slots=4), "cpu")
    sampler = GraphSampler(model, "cpu", use_graphs=False)
    engine._fast_sampler = lambda: sampler
    prompts, n = ["a=", "bcd=", "hello="], 2
    whole = engine.generate(prompts, n=n, seed=11)
    parts = [engine.generate(prompts[:2], n=n, seed=11), engine.generate(prompts[2:], n=n, seed=11, first_sample=2 * n)]
    assert parts[0].completion_ids + parts[1].completion_ids == whole.completion_ids


def test_freed_weights_come_back_with_the_next_push():
    """`free_during_train=kv_cache_and_weights`: after a rollout the engine's weights hold no storage (tied ones
    freed once), sampling is refused until a push, and a push of the same weights samples what it sampled before."""
    trainer = load_model(ModelSpec(), seed=0)
    engine = HFEngine(load_model(ModelSpec(), seed=0), byte_tokenizer(), RolloutSpec(max_new_tokens=8), "cpu",
                      free_during_train="kv_cache_and_weights")
    first = engine.generate(["a=", "bcd="], n=2, seed=3)
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    views = dict(engine.named_weights())  # restores; a transport may keep these (cuda_ipc's receiver does)
    engine.free_memory()
    with pytest.raises(RuntimeError, match="no push has restored them"):
        engine.generate(["a="], n=1, seed=3)
    engine.load_weights(trainer.state_dict().items())
    assert torch.equal(views["model.norm.weight"], trainer.model.norm.weight), "the kept views see the push"
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight, "still tied"
    assert engine.generate(["a=", "bcd="], n=2, seed=3).completion_ids == first.completion_ids
