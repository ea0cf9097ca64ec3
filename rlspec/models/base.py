"""What every model factory shares: the byte-level tokenizer of the tiny presets, dtypes by name, seeded init."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerFast

from .presets import BYTE_VOCAB_SIZE, SPECIAL_TOKENS  # noqa: F401 - the byte tokenizer's facts, importable without torch

# ChatML-style turns ending with the end-of-sequence token, so the model ends its turn with one sampled token.
# Tools, when given, are listed by name; a call is `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
BYTE_CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_start|>system\ntools: "
    "{%- for t in tools %} {{ (t.function if t.function is defined else t).name }}{% endfor %}</s>\n{% endif -%}"
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}"
    "{%- elif m.content %}{% for part in m.content %}{{ part.text }}{% endfor %}{% endif -%}"
    "{%- for call in m.tool_calls or [] %}{% set f = call.function if call.function is defined else call %}"
    "<tool_call>{\"name\": {{ f.name | tojson }}, \"arguments\": "
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}</tool_call>{% endfor -%}"
    "</s>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a transformers model's forward takes its KV cache (a `Cache` object) by: `cache` from the
    transformers release that renamed it (`past_key_values` then warns that it is deprecated), `past_key_values`
    before (the project accepts transformers from 4.56). A PEFT wrapper passes keywords on to its base model."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def checkpoint_activations(model: torch.nn.Module) -> None:
    """Recompute each layer's activations in the backward instead of keeping them (`model.gradient_checkpointing`),
    with torch's non-reentrant checkpoint: `activation_checkpointing_enable` from the transformers release that
    renamed it (the old name then warns that it is deprecated), `gradient_checkpointing_enable` before."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 4 specials (pad, bos, eos, unk) then one token per byte, no merges; its chat
    template is `BYTE_CHAT_TEMPLATE`."""
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
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", padding_side="left")
    fast.chat_template = BYTE_CHAT_TEMPLATE
    return fast


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


def pad_token_id(tokenizer) -> int:
    """The pad id of a tokenizer or of a processor's tokenizer."""
    return getattr(tokenizer, "tokenizer", tokenizer).pad_token_id


class seeded:
    """Fork the global torch RNG (and, with a CUDA `device`, that device's), seed it, restore it on exit."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.seed = seed
        self.device = torch.device(device)

    def __enter__(self) -> None:
        self._state = torch.random.get_rng_state()
        self._cuda_state = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        torch.manual_seed(self.seed)

    def __exit__(self, *exc) -> None:
        torch.random.set_rng_state(self._state)
        if self._cuda_state is not None:
            torch.cuda.set_rng_state(self._cuda_state, self.device)
