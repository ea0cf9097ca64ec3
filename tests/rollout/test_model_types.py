"""The CUDA-graph engine's forward for each model type it runs (Qwen3, Gemma 2/3, Llama 3 RoPE scaling, untied
heads), eagerly on CPU in fp32: its logits are transformers', its log-probs the trainer's, its greedy tokens
`generate`'s."""

from __future__ import annotations

import pytest
import torch

from rlspec.models.base import byte_tokenizer
from rlspec.models.factory import load_model
from rlspec.rollout.architecture import unsupported_reason
from rlspec.rollout.decoder import StaticDecoder
from rlspec.rollout.hf import HFEngine
from rlspec.rollout.sampling import SampleOptions
from rlspec.rollout.static import GraphSampler
from rlspec.spec import ModelSpec, RolloutSpec
from tests.rollout.test_static_decode import check_compiled_samples_like_plain, check_logprobs_match_trainer

PRESETS = ("tiny_qwen3", "tiny_gemma3", "tiny_gemma2", "tiny_llama3")


def _model(preset: str, tie: bool | None = None):
    model = load_model(ModelSpec(preset=preset), seed=0).eval()
    if tie is False and model.config.tie_word_embeddings:  # the same model with its own head weight
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
    return model


def _engine(model, **rollout) -> HFEngine:
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(**rollout), "cpu")
    sampler = GraphSampler(model, "cpu", use_graphs=False, check_every=4)
    engine._fast_sampler = lambda: sampler  # the CUDA path's code, without graphs, on CPU
    return engine


@pytest.fixture(scope="module", params=[*PRESETS, "tiny_qwen3_untied"])
def model(request):
    preset = request.param.removesuffix("_untied")
    return _model(preset, tie=False if request.param.endswith("_untied") else None)


def test_decoder_matches_transformers_past_the_sliding_window(model):
    """Prefill then three decode steps, left-padded, 9 positions: past the tiny Gemma presets' window of 4."""
    assert unsupported_reason(model) is None
    decoder = StaticDecoder(model)
    ids = torch.tensor([[0, 0, 101, 65, 70, 71, 72, 73, 74], [102, 103, 104, 65, 71, 80, 81, 82, 83]])
    mask = (ids != 0).long()
    positions = mask.cumsum(-1).sub(1).clamp(min=0)
    width, length = 6, 12
    keys, values = decoder.new_cache(2, length, "cpu")
    valid = torch.zeros(2, length, dtype=torch.bool)
    valid[:, :width] = mask[:, :width].bool()
    allowed = torch.ones(width, length, dtype=torch.bool).tril() & valid[:, None, :]
    with torch.no_grad():
        decoder.forward(ids[:, :width], positions[:, :width], torch.arange(width), allowed, keys, values)
        for t in range(width, ids.shape[1]):
            valid[:, t] = True
            last = decoder.forward(ids[:, t:t + 1], positions[:, t:t + 1], torch.tensor([t]), valid[:, None, :],
                                   keys, values)
            expected = model(input_ids=ids[:, :t + 1], attention_mask=mask[:, :t + 1],
                             position_ids=positions[:, :t + 1]).logits[:, -1]
            assert (last - expected).abs().max().item() < 1e-4, (t, (last - expected).abs().max().item())


def test_engine_logprobs_match_the_trainer(model):
    check_logprobs_match_trainer(_engine(model, max_new_tokens=12, temperature=0.7, top_p=0.9), model)


def test_greedy_tokens_are_generates(model):
    """Greedy decoding in the graph sampler (temperature 0) picks transformers `generate`'s tokens, and its
    log-probs are the plain loop's (log_softmax at temperature 1)."""
    engine = _engine(model, max_new_tokens=10)
    tokenizer = engine.tokenizer
    prompts = ["a=", "bcd=", "hello world="]
    rollout = engine.generate(prompts, n=1, seed=0, options=SampleOptions(greedy=True))
    _, input_ids, attention_mask = engine.encode(prompts, 1)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=10,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    reference = out[:, input_ids.shape[1]:].tolist()
    for ours, theirs in zip(rollout.completion_ids, reference):
        assert ours == theirs[:len(ours)] and len(ours) >= 1
    plain = HFEngine(model, tokenizer, RolloutSpec(max_new_tokens=10), "cpu").generate(
        prompts, n=1, seed=0, options=SampleOptions(greedy=True))
    assert plain.completion_ids == rollout.completion_ids
    diff = max(abs(a - b) for x, y in zip(plain.completion_logprobs, rollout.completion_logprobs) for a, b in zip(x, y))
    assert diff < 1e-5, diff


def test_models_the_engine_cannot_run_are_named():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", vocab_size=260, n_embd=32, n_layer=1, n_head=2)
    assert "model_type 'gpt2'" in unsupported_reason(AutoModelForCausalLM.from_config(config))
    dynamic = _model("tiny_llama3")
    dynamic.model.rotary_emb.rope_type = "dynamic"
    assert "RoPE type 'dynamic'" in unsupported_reason(dynamic)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny_qwen3", "tiny_gemma3", "tiny_gemma2"])
def test_compiled_decode_step_samples_like_the_plain_one(preset):
    """The CUDA path's decode step (fused weights, one torch.compile'd function per layer, SDPA where the model
    allows it) run on CPU without graphs: the plain blocks' tokens and log-probs. Slow (Inductor compiles)."""
    check_compiled_samples_like_plain(_model(preset), compile_layers=True, sdpa=True)
