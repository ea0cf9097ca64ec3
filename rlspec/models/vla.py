"""Vision-language-action policies: the tiny preset, loading a local checkpoint, actions as tokens.

The preset is transformers' own `LlavaForConditionalGeneration` (a CLIP vision tower, a two-layer MLP
projector, a Qwen2 language model), random-init with a fixed seed, with a `LlavaProcessor` built in
memory (rlspec's byte tokenizer + an `<image>` token + a CLIP image processor). A real checkpoint of an
image-text-to-text class loads from `model.path` with `AutoModelForImageTextToText` / `AutoProcessor`.

Actions are tokens, as in OpenVLA: action `a` of an environment with N discrete actions is the token id
`vocab_size - N + a`, i.e. the last N ids of the tokenizer's *base* vocabulary (added special tokens such
as `<image>` or `<pad>` come after it and are never used). For the byte tokenizer these are the bytes
0xF9..0xFF, which never occur in UTF-8 text. The policy over actions is the softmax of the LM-head
logits restricted to those N ids (as vlarl does for OpenVLA's 256 bins), in sampling and in training
alike (`rlspec.core.policy`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..spec import ModelSpec, SpecError
from .presets import VLA_PRESETS

IMAGE_TOKEN = "<image>"

def _byte_processor(preset: dict):
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    from .base import byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    size = preset["image_size"]
    # The PIL image processor: the torchvision one needs a package CPU installs rarely have.
    images = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                   do_resize=True, do_center_crop=True)
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=preset["patch_size"],
                          vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                          num_additional_image_tokens=1)


def preset_config(name: str, attn_implementation: str = "eager"):
    """The `LlavaConfig` of a VLA preset (vocabulary: byte tokens + specials + `<image>`)."""
    from transformers import LlavaConfig

    from .base import BYTE_VOCAB_SIZE

    preset = VLA_PRESETS[name]
    image_token_id = BYTE_VOCAB_SIZE  # the first id after the byte tokenizer's vocabulary
    num_patches = (preset["image_size"] // preset["patch_size"]) ** 2
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", image_size=preset["image_size"],
                           patch_size=preset["patch_size"], num_channels=3, **preset["vision"]),
        text_config=dict(model_type="qwen2", vocab_size=image_token_id + 1, tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, **preset["text"]),
        image_token_id=image_token_id, image_seq_length=num_patches, vision_feature_select_strategy="default",
        vision_feature_layer=-1, projector_hidden_act="gelu", tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = attn_implementation
    return config


def load_processor(spec: ModelSpec):
    """The preset's processor built in memory, or `AutoProcessor` from `model.path` (nothing downloads)."""
    if spec.path is None:
        return _byte_processor(VLA_PRESETS[spec.preset])
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(spec.path)
    tokenizer = processor.tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return processor


def load_model(spec: ModelSpec, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText, LlavaForConditionalGeneration

    from .base import seeded

    if spec.path is None:
        config = preset_config(spec.preset, spec.attn_implementation)
        with seeded(seed):
            return LlavaForConditionalGeneration._from_config(config, dtype=dtype,
                                                              attn_implementation=spec.attn_implementation)
    return AutoModelForImageTextToText.from_pretrained(spec.path, dtype=dtype,
                                                       attn_implementation=spec.attn_implementation)


def action_token_ids(tokenizer, num_actions: int) -> list[int]:
    """Token id of each action: the last `num_actions` ids of the base vocabulary (see the module docstring)."""
    base = tokenizer.vocab_size
    ids = list(range(base - num_actions, base))
    special = set(tokenizer.all_special_ids)
    clash = [i for i in ids if i in special]
    if num_actions > base or clash:
        raise SpecError("model.path", f"the tokenizer's last {num_actions} base ids {ids[:3]}... include special "
                        f"tokens {clash}", "use a tokenizer whose base vocabulary ends in ordinary tokens")
    return ids


class PromptEncoder:
    """Observations (RGB image + instruction) -> prompt token ids and `pixel_values`, with the model's processor."""

    def __init__(self, processor, template: str) -> None:
        self.processor = processor
        self.template = template
        self.image_token = getattr(processor, "image_token", IMAGE_TOKEN)

    def __call__(self, images: list[np.ndarray], instructions: list[str]) -> tuple[list[list[int]], torch.Tensor]:
        texts = [self.template.format(image=self.image_token, instruction=text) for text in instructions]
        out = self.processor(text=texts, images=list(images), return_tensors="pt", padding=True)
        ids = [row[mask.bool()].tolist() for row, mask in zip(out["input_ids"], out["attention_mask"])]
        return ids, out["pixel_values"]

