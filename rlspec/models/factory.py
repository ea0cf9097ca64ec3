"""Model and tokenizer factories: tiny presets built from a config, or a local Hugging Face directory.

Nothing here downloads: presets are random-init from a transformers config with a fixed seed and a
byte-level tokenizer built in memory; real models load from `model.path`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from ..spec import ModelSpec, SpecError
from .base import DTYPES, byte_tokenizer, seeded
from .presets import PRESETS


def check_model_spec(spec: ModelSpec) -> None:
    """Refuse, before anything is built, an unknown preset or a `model.path` that would not load as it should:
    unreadable config, no tokenizer, missing, corrupt or truncated weights (the compiler has checked that
    the directory and its config.json exist)."""
    if spec.kind == "vla":
        from .vla import check_preset

        return check_preset(spec)
    if spec.path is None:
        if spec.preset not in PRESETS:
            raise SpecError("model.preset", f"unknown preset {spec.preset!r}",
                            f"use one of: {', '.join(PRESETS)}, or set model.path to a local model directory")
        return
    path, key = Path(spec.path), "model.path"
    config = read_config(path, key)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise SpecError(key, f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})",
                        "save it there with tokenizer.save_pretrained(model.path)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(path.glob("pytorch_model*.bin")):
            return  # legacy PyTorch weights: transformers checks them while loading
        raise SpecError(key, f"{path} holds no weights (*.safetensors)", "save the model there with save_pretrained")
    check_weights(files, config, key, strict=False)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""One of these must be beside a `model.path` model: without them `AutoTokenizer` silently builds an
empty tokenizer from the config's model type (every prompt encodes to no tokens)."""
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


def read_config(path: Path, key: str):
    """The Hugging Face config of a model directory; an unreadable one is a `SpecError` naming `key`."""
    import json

    from transformers import AutoConfig

    from ..spec.files import read_text

    try:
        json.loads(read_text(path / "config.json", key, "a Hugging Face config.json"))
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except SpecError:
        raise
    except Exception as err:  # noqa: BLE001 - json and transformers raise many types for a bad config
        raise SpecError(key, f"{path / 'config.json'} cannot be read ({type(err).__name__}: {str(err)[:200]})",
                        "save the model there again with save_pretrained") from None


def safetensors_header(file: Path, key: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """`{name: (dtype, shape)}` of a safetensors file, after checking that its header is intact and that the
    file holds every byte the header describes (a truncated copy fails here, not inside `from_pretrained`)."""
    import json

    fix = "copy or save the file again (an interrupted download or copy leaves it truncated)"
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= size - 8:
                raise SpecError(key, f"{file} is not a safetensors file (corrupt or truncated header)", fix)
            header = json.loads(f.read(length))
    except (OSError, ValueError) as err:
        raise SpecError(key, f"{file} has a corrupt safetensors header ({type(err).__name__})", fix) from None
    header.pop("__metadata__", None)
    tensors, end = {}, 0
    for name, info in header.items():
        try:
            begin, stop = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            dtype = info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise SpecError(key, f"{file} has a corrupt safetensors header (entry {name!r})", fix) from None
        width = _SAFETENSORS_BYTES.get(dtype)
        if width is not None and stop - begin != width * math.prod(shape):
            raise SpecError(key, f"{file} is corrupt: tensor {name!r} has {stop - begin} bytes for shape {list(shape)}", fix)
        tensors[name] = (dtype, shape)
        end = max(end, stop)
    if 8 + length + end > size:
        raise SpecError(key, f"{file} is truncated: its header describes {8 + length + end} bytes, the file has {size}", fix)
    return tensors


def check_weights(files: list[Path], config, key: str, strict: bool, fix: str = "") -> None:
    """Refuse safetensors `files` that are corrupt or do not fit the model `config` builds.

    Every tensor whose name the model has must have the model's shape. `strict` (rlspec's own
    checkpoints) also refuses names the model lacks and weights the files lack; otherwise (a user's
    `model.path`, which transformers may rename while loading) the files only need to share names with it.
    """
    found: dict[str, tuple[int, ...]] = {}
    for file in files:
        found.update({name: shape for name, (_, shape) in safetensors_header(file, key).items()})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = model.state_dict(keep_vars=True)
    fix = fix or "point model.path at the model these weights belong to"
    for name, shape in found.items():
        if name in params and tuple(params[name].shape) != shape:
            raise SpecError(key, f"{files[0].parent} holds weights of another model: {name} is {list(shape)}, "
                            f"the config's model has {list(params[name].shape)}", fix)
    shared = [name for name in found if name in params]
    if not shared:
        raise SpecError(key, f"{files[0].parent} holds no weight of this model (e.g. it has {next(iter(found), 'none')!r}, "
                        f"the model expects {next(iter(params))!r})", fix)
    if strict:
        unknown = [name for name in found if name not in params]
        by_tensor: dict[int, list[str]] = {}
        for name, tensor in params.items():  # tied weights are one tensor under several names
            by_tensor.setdefault(id(tensor), []).append(name)
        missing = [names[0] for names in by_tensor.values() if not any(n in found for n in names)]
        if unknown or missing:
            detail = f"weights this model lacks: {unknown[:3]}" if unknown else f"no weight for {missing[:3]}"
            raise SpecError(key, f"{files[0].parent} holds weights of another model ({detail})", fix)


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
        with seeded(seed):
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
    with seeded(seed + 1):
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
