"""Model and tokenizer factories: tiny presets built from a config, or a local Hugging Face directory.

Nothing here downloads: presets are random-init from a transformers config with a fixed seed and a
byte-level tokenizer built in memory; real models load from `model.path`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .spec import ModelSpec, SpecError

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

# Shapes only; weights are random. `vocab_size` may exceed the byte vocabulary to keep a real model's
# embedding and LM-head cost (ids past the tokenizer's vocabulary decode to nothing).
PRESETS: dict[str, dict] = {
    "tiny_qwen2": dict(model_type="qwen2", vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, tie_word_embeddings=True),
    "qwen2_0p5b_shape": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                             max_position_embeddings=4096, tie_word_embeddings=True),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 4 specials (pad, bos, eos, unk) then one token per byte, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    # ByteLevel.alphabet() is unordered; order by the byte each symbol stands for.
    byte_to_symbol = _bytes_to_unicode()
    assert set(byte_to_symbol.values()) == set(alphabet)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({byte_to_symbol[b]: len(SPECIAL_TOKENS) + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", padding_side="left")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the mapping ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def check_model_spec(spec: ModelSpec) -> None:
    """Refuse an unknown preset before anything is built (a local `path` is checked by the compiler)."""
    if spec.kind == "vla":
        from .vla import check_preset

        return check_preset(spec)
    if spec.path is None and spec.preset not in PRESETS:
        raise SpecError("model.preset", f"unknown preset {spec.preset!r}",
                        f"use one of: {', '.join(PRESETS)}, or set model.path to a local model directory")


def preset_config(name: str, attn_implementation: str = "eager"):
    from transformers import AutoConfig

    if name not in PRESETS:
        raise SpecError("model.preset", f"unknown preset {name!r}", f"use one of: {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, pad_token_id=0, bos_token_id=1, eos_token_id=2, **fields)
    config._attn_implementation = attn_implementation
    return config


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    """The tokenizer; for `model.kind: vla` the processor (tokenizer + image processor, saved with the model)."""
    if spec.kind == "vla":
        from .vla import load_processor

        return load_processor(spec)
    if spec.path is None:
        return byte_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(spec.path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(spec: ModelSpec, seed: int) -> torch.nn.Module:
    """The initial policy in `spec.dtype`, on CPU; identical for a given seed in every process."""
    dtype = DTYPES[spec.dtype]
    if spec.kind == "vla":
        from . import vla

        model = vla.load_model(spec, seed, dtype)
    elif spec.path is None:
        config = preset_config(spec.preset, spec.attn_implementation)
        with _seeded(seed):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=spec.attn_implementation)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype, attn_implementation=spec.attn_implementation)
    model.generation_config.pad_token_id = getattr(model.config, "pad_token_id", None)
    return model


def pad_token_id(tokenizer) -> int:
    """The pad id of a tokenizer or of a processor's tokenizer."""
    return getattr(tokenizer, "tokenizer", tokenizer).pad_token_id


def apply_lora(model: torch.nn.Module, spec: ModelSpec, seed: int) -> torch.nn.Module:
    """Wrap `model` with PEFT LoRA adapters (A random with `seed`, B zero) when `spec.lora.r > 0`."""
    if spec.lora.r == 0:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:  # pragma: no cover - depends on the install
        raise SpecError("model.lora.r", "LoRA needs the peft package", "pip install 'rlspec[lora]'") from err
    config = LoraConfig(r=spec.lora.r, lora_alpha=spec.lora.alpha, lora_dropout=spec.lora.dropout,
                        target_modules=list(spec.lora.target_modules), bias="none")
    with _seeded(seed + 1):
        return get_peft_model(model, config)


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in `path` (one model, possibly sharded), by name."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@torch.no_grad()
def copy_weights(model: torch.nn.Module, named_tensors) -> None:
    """Copy `(name, tensor)`s into `model`'s weights by state-dict name, cast to each weight's device
    and dtype (tied weights appear under both names); an unknown name raises KeyError."""
    params = model.state_dict(keep_vars=True)
    for name, tensor in named_tensors:
        if name not in params:
            raise KeyError(f"model has no weight named {name!r}")
        params[name].copy_(tensor.to(params[name].device, params[name].dtype))


def save_hf(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None, path: Path,
            state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """`save_pretrained` in safetensors (merging LoRA adapters into the base weights first)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per shard would interleave with the run's own progress
    if hasattr(model, "merge_and_unload"):
        import copy

        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


class _seeded:
    """Fork the global torch RNG, seed it, restore it on exit."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __enter__(self) -> None:
        self._state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc) -> None:
        torch.random.set_rng_state(self._state)
