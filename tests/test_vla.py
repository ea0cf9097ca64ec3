"""Vision-language-action path: the preset and its local round trip, actions as tokens, images through the
shared forward, the action log-prob the sampler and the trainer share, and the env spec checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlspec.core.batch import TrainBatch
from rlspec.models.factory import load_model, load_tokenizer, save_hf
from rlspec.core.policy import forward_logits, sequence_logprobs
from rlspec.spec import ModelSpec, SpecError
from rlspec.models.vla import PromptEncoder, action_token_ids
from tests.conftest import REPO

SPEC = ModelSpec(preset="tiny_llava", kind="vla")


@pytest.fixture(scope="module")
def preset():
    return load_model(SPEC, seed=0).eval(), load_tokenizer(SPEC)


def _observations(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(n)]
    texts = ["go to the red ball", "open the door", "pick up a key"][:n]
    return images, texts


def test_preset_is_seeded_and_loads_back_from_a_local_directory(preset, tmp_path):
    model, processor = preset
    again = load_model(SPEC, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert "Qwen2DecoderLayer" in model._no_split_modules  # what a sharded backend wraps per block

    save_hf(model, processor, tmp_path)
    local = ModelSpec(path=str(tmp_path), kind="vla")
    loaded, loaded_processor = load_model(local, seed=123).eval(), load_tokenizer(local)
    images, texts = _observations(2)
    ids, pixels = PromptEncoder(processor, "{image}{instruction}\n")(images, texts)
    ids2, pixels2 = PromptEncoder(loaded_processor, "{image}{instruction}\n")(images, texts)
    assert ids == ids2 and torch.equal(pixels, pixels2)
    assert ids[0].count(model.config.image_token_id) == 49  # 7x7 patches of 8 pixels, CLS dropped
    x = torch.tensor([ids[0]])
    with torch.no_grad():
        want = forward_logits(model, x, torch.ones_like(x), pixels[:1])
        got = forward_logits(loaded, x, torch.ones_like(x), pixels2[:1])
    assert torch.equal(want, got)


def test_actions_are_the_last_base_vocabulary_ids(preset):
    _, processor = preset
    tokenizer = processor.tokenizer
    ids = action_token_ids(tokenizer, 7)
    assert ids == list(range(tokenizer.vocab_size - 7, tokenizer.vocab_size)) == list(range(253, 260))
    assert not set(ids) & set(tokenizer.all_special_ids)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert image_id not in ids and image_id >= tokenizer.vocab_size  # added tokens live after the base vocabulary
    # Bytes 0xF9..0xFF never occur in UTF-8 text, so an instruction never contains an action token.
    assert not set(tokenizer("go to the red ball — ü").input_ids) & set(ids)


def test_action_ids_refuse_a_tokenizer_ending_in_specials():
    class Tok:
        vocab_size = 10
        all_special_ids = [8, 9]

    with pytest.raises(SpecError, match="special"):
        action_token_ids(Tok(), 3)


def test_sampler_and_trainer_share_the_action_distribution(preset):
    """The probability the sampler draws an action from is exp(the trainer's log-prob) of that action token."""
    from rlspec.envs.rollout import collate_rows, sample_actions

    model, processor = preset
    images, texts = _observations(3)
    prompts, pixels = PromptEncoder(processor, "{image}{instruction}\n")(images, texts)
    action_ids = torch.tensor(action_token_ids(processor.tokenizer, 7))
    # Every action after every prompt: 21 rows (prompts of different lengths, right-padded).
    rows = [(p, pixels[i], int(a), 0.0, 0.0) for i, p in enumerate(prompts) for a in action_ids]
    batch = collate_rows(rows, action_ids, pad_id=0)
    logp, _ = sequence_logprobs(model, batch, temperature=0.7)
    picked = (logp * batch.loss_mask).sum(-1).view(3, 7)
    assert torch.allclose(picked.exp().sum(-1), torch.ones(3), atol=1e-5)  # a distribution over the 7 actions
    assert (logp * (1 - batch.loss_mask)).abs().max() == 0  # prompt tokens carry no log-prob
    # Empirical check of the sampler against those probabilities.
    draws = sample_actions(model, prompts * 200, pixels.repeat(200, 1, 1, 1), action_ids, 0.7, 1.0, 0,
                           torch.device("cpu"), torch.Generator().manual_seed(0)).view(200, 3)
    freq = torch.stack([torch.bincount(draws[:, i], minlength=7).float() / 200 for i in range(3)])
    assert (freq - picked.exp()).abs().max() < 0.12  # 200 draws: 4 standard errors of the largest p(1-p)


def test_batch_carries_images_through_select_trim_and_shard():
    n = 4
    batch = TrainBatch(input_ids=torch.ones(n, 6, dtype=torch.long),
                       attention_mask=torch.tensor([[1] * 4 + [0] * 2] * n), loss_mask=torch.zeros(n, 6),
                       advantages=torch.arange(n).float(), rewards=torch.zeros(n),
                       pixel_values=torch.arange(n).float().view(n, 1, 1, 1).expand(n, 3, 4, 4).clone(),
                       action_vocab=torch.arange(7).expand(n, 7).clone())
    trimmed = batch.trimmed()
    assert trimmed.input_ids.shape == (n, 4) and trimmed.pixel_values.shape == (n, 3, 4, 4)
    assert trimmed.action_vocab.shape == (n, 7)
    shard = batch.shard(1, 2)
    assert shard.pixel_values[:, 0, 0, 0].tolist() == [2.0, 3.0] and len(shard.action_vocab) == 2
    assert [len(c.pixel_values) for c in batch.chunks(3)] == [3, 1]
    assert set(TrainBatch.from_tensors(batch.tensors()).tensors()) == set(batch.tensors())


def _plan(*overrides: str):
    from rlspec.run import build_plan

    return build_plan(str(REPO / "examples" / "vla_babyai.yaml"), list(overrides))[0]


@pytest.mark.parametrize("overrides, key", [
    (["model=tiny_qwen2"], "rollout.env.name"),  # an env needs model.kind=vla
    (["rollout.env.name=null"], "rollout.env.name"),  # vla needs an env
    (["rollout.max_new_tokens=4"], "rollout.max_new_tokens"),
    (["model.preset=tiny_qwen2"], "model.preset"),
    (["rollout.env.level=BabyAI-NoSuchLevel-v0"], "rollout.env.level"),
    (["+rollout.env.kwargs.colour=red"], "rollout.env.kwargs"),
    (["rollout.env.num_actions=9"], "rollout.env.num_actions"),
    (["rollout.env.prompt_template=no-image"], "rollout.env.prompt_template"),
    (["backend=deepspeed"], "model.kind"),
])
def test_bad_vla_specs_name_the_key(overrides, key):
    with pytest.raises(SpecError) as err:
        _plan(*overrides)
    assert err.value.where.startswith(key), err.value
    if key == "model.kind":
        assert "standalone" in str(err.value)  # names the backends that run VLA


def test_example_compiles():
    plan = _plan()
    assert plan.spec.model.kind == "vla" and plan.spec.rollout.env.name == "minigrid"
    assert plan.spec.rollout.max_new_tokens == 1
