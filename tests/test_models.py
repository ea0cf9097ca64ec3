"""Model factories: seeded presets, the byte tokenizer, local directories, LoRA export."""

from __future__ import annotations

import pytest
import torch

from rlspec.models.factory import PRESETS, load_model, load_tokenizer, preset_config, save_hf
from rlspec.models.base import byte_tokenizer
from rlspec.spec import LoraSpec, ModelSpec


def test_presets_are_seeded():
    a, b, c = load_model(ModelSpec(), 0), load_model(ModelSpec(), 0), load_model(ModelSpec(), 1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.state_dict()["model.embed_tokens.weight"], c.state_dict()["model.embed_tokens.weight"])


def test_half_billion_shape_preset_has_qwen2_0p5b_size():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config("qwen2_0p5b_shape"))
    count = sum(p.numel() for p in model.parameters())
    assert 480e6 < count < 510e6, count  # Qwen2-0.5B: 494M with tied embeddings
    assert {"tiny_qwen2", "qwen2_0p5b_shape", "qwen2_24l_tiny"} <= set(PRESETS)


@pytest.mark.parametrize("name,low,high", [("qwen2_1p5b_shape", 1.50e9, 1.56e9), ("qwen2_7b_shape", 7.55e9, 7.65e9)])
def test_scale_presets_have_the_published_sizes(name, low, high):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(name))
    count = sum(p.numel() for p in model.parameters())
    assert low < count < high, count  # Qwen2.5-1.5B: 1.54B (tied embeddings); Qwen2.5-7B: 7.62B


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_plan_parameter_count_is_the_built_models(name):
    """`parameter_count` (what the plan sizes ZeRO-1 against, without building the model) counts every preset's
    parameters exactly: qwen2's biases, qwen3's and gemma's q/k norms, gemma's four norms a layer, tied or not."""
    from transformers import AutoModelForCausalLM

    from rlspec.models.presets import parameter_count

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(name))
    assert parameter_count(PRESETS[name]) == sum(p.numel() for p in model.parameters())


def test_byte_tokenizer_roundtrip():
    tok = byte_tokenizer()
    text = "Grüße, 7 × 8 = 56!\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text.encode()) and all(4 <= i < 260 for i in ids)
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_local_directory_round_trip(tmp_path):
    model, tok = load_model(ModelSpec(), 3), byte_tokenizer()
    save_hf(model, tok, tmp_path)
    spec = ModelSpec(path=str(tmp_path))
    loaded = load_model(spec, seed=99)  # the seed does not matter for a saved model
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert load_tokenizer(spec)("abc=").input_ids == tok("abc=").input_ids


def test_lora_export_is_the_merged_base_model():
    pytest.importorskip("peft")
    from rlspec.core.trainer import full_state_dict
    from rlspec.models.factory import apply_lora

    spec = ModelSpec(lora=LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    base = load_model(spec, 0)
    reference = {k: v.clone() for k, v in base.state_dict().items()}
    model = apply_lora(base, spec, 0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    merged = full_state_dict(model)
    assert set(merged) == set(reference)
    q = "model.layers.0.self_attn.q_proj.weight"
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    want = reference[q] + (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * (8 / 4)
    torch.testing.assert_close(merged[q], want)
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], reference["model.layers.0.mlp.up_proj.weight"])
