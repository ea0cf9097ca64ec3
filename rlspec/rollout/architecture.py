"""What `StaticDecoder` needs to know of a transformers decoder beyond its shapes, read from the module and its
config, and why it cannot run one.

The decoders it runs are one family with a few switches, each following the transformers implementation of that
model type to the rounding:

- Llama-style (`qwen2`, `llama`, `mistral`): pre-norm layers, RMSNorm `w * x.to(dtype)`, SwiGLU, head_dim^-0.5;
- `qwen3`: the same with an RMSNorm on each head's q and k before RoPE (`qk_norm`);
- `gemma2`, `gemma3_text`: RMSNorm `(x * (1 + w)).to(dtype)` in fp32 (`offset_norm`), a norm after attention and
  after the MLP as well as before each (`sandwich`), GeGLU (gelu with the tanh approximation), embeddings scaled by
  sqrt(hidden) rounded to the model dtype, scores scaled by `query_pre_attn_scalar`^-0.5, layers alternating
  between a sliding window and full attention, each kind with its own RoPE (Gemma 3); Gemma 2 soft-caps the
  attention scores and the final logits (`cap * tanh(x / cap)`), Gemma 3 norms q and k (`qk_norm`).

RoPE of any kind whose frequencies do not depend on the sequence length (default, linear, llama3, yarn: the
module's `inv_freq` and `attention_scaling`) is read from the model's rotary module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.presets import FAST_MODEL_TYPES

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE kinds whose frequencies are fixed at load (the others rescale with the sequence length)."""
GEMMA_TYPES = ("gemma2", "gemma3_text")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_python_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Architecture:
    model_type: str
    qk_norm: bool
    """RMSNorm over each head's q and k (the attention module's `q_norm`, `k_norm`) before RoPE."""
    offset_norm: bool
    """Gemma's RMSNorm: `(x_normed * (1 + w))` in fp32, then rounded (else `w * x_normed.to(dtype)`)."""
    sandwich: bool
    """Norms after attention and after the MLP too (`post_attention_layernorm` then normalises attention's output,
    `pre_feedforward_layernorm` the MLP's input, `post_feedforward_layernorm` its output)."""
    activation: str
    """silu | gelu_tanh: the gate's activation."""
    embed_scale: float | None
    """Multiplies the embeddings (rounded to the model dtype) where the embedding module does not itself."""
    scaling: float
    attn_softcap: float | None
    final_softcap: float | None
    sliding_window: int | None
    layer_types: tuple[str, ...]
    """Per layer: full_attention | sliding_attention (a key at most `sliding_window` - 1 positions back)."""

    @property
    def sliding(self) -> tuple[bool, ...]:
        return tuple(t == "sliding_attention" for t in self.layer_types)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `StaticDecoder` cannot run `model` (None when it can)."""
    if hasattr(model, "peft_config"):
        return "the model carries LoRA adapters"
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAST_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(FAST_MODEL_TYPES)}"
    kinds = set(layer_types(config))
    if not kinds <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(kinds)} (only full_attention and sliding_attention)"
    if "sliding_attention" in kinds and not getattr(config, "sliding_window", None):
        return "sliding_attention layers without a sliding_window"
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"hidden activation {act!r} is not one of {', '.join(ACTIVATIONS)}"
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or getattr(body, "rotary_emb", None) is None:
        return "the model has no decoder body with a rotary embedding (model.model.rotary_emb)"
    for kind in kinds:
        module, inv_freq, scaling = rope_attributes(body, kind)
        if not (hasattr(getattr(body, module), inv_freq) and hasattr(getattr(body, module), scaling)):
            return (f"no RoPE frequencies for {kind} layers where this transformers version was read "
                    f"({module}.{inv_freq})")
        rope = rope_type(body, kind)
        if rope not in STATIC_ROPE_TYPES:
            return f"RoPE type {rope!r} ({kind}) is not one of {', '.join(STATIC_ROPE_TYPES)}"
    return None


def layer_types(config) -> tuple[str, ...]:
    """Each layer's attention kind; Mistral's config has none, and a `sliding_window` there applies to every layer."""
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(types)
    sliding = config.model_type == "mistral" and getattr(config, "sliding_window", None)
    return ("sliding_attention" if sliding else "full_attention",) * config.num_hidden_layers


def rope_type(body: torch.nn.Module, layer_type: str) -> str | None:
    rotary = getattr(body, rope_attributes(body, layer_type)[0])
    kinds = getattr(rotary, "rope_type", "default")
    return kinds.get(layer_type) if isinstance(kinds, dict) else kinds


def rope_attributes(body: torch.nn.Module, layer_type: str) -> tuple[str, str, str]:
    """Where `layer_type`'s RoPE is: (rotary module, its inv_freq, its attention_scaling) attribute names on the
    decoder body. Gemma 3 keeps a pair per layer type on `rotary_emb` (`sliding_attention_inv_freq`, ...; transformers
    before 5 had a second module, `rotary_emb_local`, for the sliding layers), other models one for all layers. Names,
    read again at each use: moving the model to a device replaces its buffers."""
    if hasattr(body.rotary_emb, f"{layer_type}_inv_freq"):
        return "rotary_emb", f"{layer_type}_inv_freq", f"{layer_type}_attention_scaling"
    if layer_type == "sliding_attention" and hasattr(body, "rotary_emb_local"):
        return "rotary_emb_local", "inv_freq", "attention_scaling"
    return "rotary_emb", "inv_freq", "attention_scaling"


def architecture(model: torch.nn.Module) -> Architecture:
    config = model.config
    model_type = config.model_type
    gemma = model_type in GEMMA_TYPES
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attn = model.model.layers[0].self_attn
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    embed = model.get_input_embeddings()
    # transformers' Gemma embedding modules scale their own output (`embed_scale`); a plain embedding does not
    scale = math.sqrt(config.hidden_size) if gemma and not hasattr(embed, "embed_scale") else None
    types = layer_types(config)
    query_scalar = getattr(config, "query_pre_attn_scalar", None) if gemma else None
    return Architecture(
        model_type=model_type, qk_norm=hasattr(attn, "q_norm"), offset_norm=gemma, sandwich=gemma,
        activation=ACTIVATIONS[act], embed_scale=scale,
        scaling=(query_scalar or head_dim) ** -0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None) if model_type == "gemma2" else None,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        sliding_window=getattr(config, "sliding_window", None) if "sliding_attention" in types else None,
        layer_types=types)
