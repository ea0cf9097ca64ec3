"""Model and tokenizer factories: tiny presets built from a config, or a local Hugging Face directory.

Nothing here downloads: presets are random-init from a transformers config with a fixed seed and a
byte-level tokenizer built in memory; real models load from `model.path`.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Iterator

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from ..spec import ModelSpec, SpecError
from .base import DTYPES, byte_tokenizer, seeded
from .presets import PRESETS

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


def load_model(spec: ModelSpec, seed: int, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The initial policy in `spec.dtype`; identical for a given seed and device type in every process.

    A preset is initialised where it will run: on a CUDA `device` directly in `spec.dtype` (the 7B shape in well
    under a second, where initialising it on the host took minutes), so every process of a CUDA run must pass
    its CUDA device for trainer and engines to start from the same weights. A VLA policy and a local directory
    load on the host and are moved by the caller."""
    dtype = DTYPES[spec.dtype]
    if spec.kind == "vla":
        from . import vla

        model = vla.load_model(spec, seed, dtype)
    elif spec.path is None:
        config = preset_config(spec.preset, spec.attn_implementation)
        with seeded(seed, device), torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=spec.attn_implementation)
        if spec.eos_hazard:
            set_eos_hazard(model, spec.eos_hazard)
    else:
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype, attn_implementation=spec.attn_implementation)
    model.generation_config.pad_token_id = getattr(model.config, "pad_token_id", None)
    return model


EOS_CARRIER_SCALE = 1024.0
"""The constant the last attention layer writes into the residual's carrier dimension: large enough that the final
RMSNorm maps it to sqrt(hidden) whatever the rest of the residual holds (its share of the norm is below 1e-3)."""


@torch.no_grad()
def set_eos_hazard(model: torch.nn.Module, hazard: float) -> None:
    """Make the end token's probability `hazard` at every step (temperature 1) by editing random-init weights.

    One residual dimension j becomes a constant carrier: no embedding, attention output or MLP output writes it,
    except the last layer's attention, whose value channel 0 of K/V head 0 is its bias alone (1; attention
    weights sum to 1, so the head outputs 1 at every position) and whose output projection reads that channel
    into j only, times `EOS_CARRIER_SCALE`. After the final RMSNorm, h_j = sqrt(hidden) and every other h_k is
    the random residual squashed by the carrier (~1e-2), so the other tokens' logits are ~0 and the end token's
    logit is its LM-head weight on j times sqrt(hidden): set to log(hazard * (V - 1) / (1 - hazard)). Every
    matmul of the model still runs on random weights; only the length distribution is fixed: geometric, median
    ln 2 / hazard, cut at the budget. Needs a value-projection bias (the qwen2 presets have one).
    """
    config = model.config
    body, head = model.model, model.get_output_embeddings().weight
    attn = body.layers[-1].self_attn
    if attn.v_proj.bias is None:
        raise SpecError("model.eos_hazard", f"model_type {config.model_type!r} has no value-projection bias to carry "
                        "the end token's logit", "use a qwen2 preset")
    carrier, eos, vocab = config.hidden_size - 1, config.eos_token_id, config.vocab_size
    for layer in body.layers:
        layer.self_attn.o_proj.weight[carrier] = 0
        layer.mlp.down_proj.weight[carrier] = 0
    body.embed_tokens.weight[:, carrier] = 0
    head[:, carrier] = 0
    attn.v_proj.weight[0] = 0
    attn.v_proj.bias[0] = 1
    attn.o_proj.weight[:, 0] = 0
    attn.o_proj.weight[carrier, 0] = EOS_CARRIER_SCALE
    body.norm.weight[carrier] = 1
    head[eos] = 0
    head[eos, carrier] = math.log(hazard * (vocab - 1) / (1 - hazard)) / math.sqrt(config.hidden_size)


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
    with seeded(seed + 1), warnings.catch_warnings():
        # peft reads the model's `is_gradient_checkpointing`, which transformers renamed (the old name warns)
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
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


def save_gathered(named: Iterator[tuple[str, torch.Tensor]], payload: tuple) -> None:
    """A sender function for a sharded trainer's `run_sender`: rank 0 writes the gathered weights `named` as
    `save_hf((model, tokenizer, path) = payload)` does, while the other ranks only take part in the gathers."""
    model, tokenizer, path = payload
    save_hf(model, tokenizer, path, state_dict={name: t.cpu() for name, t in named})
