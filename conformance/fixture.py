"""The fixed rollout batch: prompts + completions + rewards, so generation randomness is out of the comparison.

8 sequences = 2 prompts x 4 completions, right-padded. Token ids are drawn with a fixed seed (no
tokenizer or engine involved). Completion lengths are chosen so that on 2 data-parallel ranks
(contiguous halves, `TrainBatch.shard`) rank 0 holds 66 completion tokens and rank 1 only 16, and so
that every micro-batch of 2 mixes a long and a short completion: a local token-count normaliser is off
by a large factor, and padding handling is exercised in every micro-batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..core.batch import TrainBatch
from ..core.grpo import group_advantages
from ..models.base import BYTE_VOCAB_SIZE, SPECIAL_TOKENS
from ..spec import AlgorithmSpec

SEED = 1234
GROUP_SIZE = 4
NUM_PROMPTS = 2
MAX_NEW_TOKENS = 24
"""Also Dr. GRPO's constant normaliser L_max."""
PROMPT_LENGTHS = (5, 5, 5, 5, 7, 7, 7, 7)
"""One prompt per group, repeated for each completion."""
COMPLETION_LENGTHS = (24, 18, 10, 14, 3, 6, 2, 5)
"""Rank 0 of 2: 66 tokens; rank 1: 16. The longest completion fills `MAX_NEW_TOKENS`."""
ENDS_WITH_EOS = (False, True, True, True, True, False, True, True)
REWARDS = (1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.0)
"""Distinct within each group, so every advantage is non-zero."""

PAD_ID, EOS_ID = SPECIAL_TOKENS.index("<pad>"), SPECIAL_TOKENS.index("</s>")


@dataclass(frozen=True)
class Fixture:
    """The rollout batch as stored in `fixture/batch.safetensors` (right-padded, [N, L] and [N])."""

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    """1.0 on completion tokens."""
    rewards: Tensor
    pixel_values: Tensor | None = None
    """[N, 3, H, W] one image per sequence (the VLA fixture)."""
    action_vocab: Tensor | None = None
    """[N, A] the action token ids (the VLA fixture)."""

    def train_batch(self, algo: AlgorithmSpec) -> TrainBatch:
        """A fresh `TrainBatch` with the advantages `algo` prescribes (the step template fills in the rest)."""
        advantages = group_advantages(self.rewards, algo.group_size, algo.adv_norm, algo.adv_eps)
        # Rows with no completion token (VLA padding rows) get no advantage, as the env rollout gives them.
        advantages = advantages * (self.loss_mask.sum(-1) > 0)
        return TrainBatch(input_ids=self.input_ids.clone(), attention_mask=self.attention_mask.clone(),
                          loss_mask=self.loss_mask.clone(), advantages=advantages, rewards=self.rewards.clone(),
                          pixel_values=None if self.pixel_values is None else self.pixel_values.clone(),
                          action_vocab=None if self.action_vocab is None else self.action_vocab.clone())

    def tensors(self) -> dict[str, Tensor]:
        out = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "loss_mask": self.loss_mask,
               "rewards": self.rewards, "pixel_values": self.pixel_values, "action_vocab": self.action_vocab}
        return {k: v for k, v in out.items() if v is not None}

    def save(self, directory: Path) -> None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tensors().items()}, str(directory / "batch.safetensors"))


def build_fixture() -> Fixture:
    generator = torch.Generator().manual_seed(SEED)
    first_regular = len(SPECIAL_TOKENS)
    prompts = [torch.randint(first_regular, BYTE_VOCAB_SIZE, (PROMPT_LENGTHS[g * GROUP_SIZE],), generator=generator)
               for g in range(NUM_PROMPTS)]
    length = max(p + c for p, c in zip(PROMPT_LENGTHS, COMPLETION_LENGTHS))
    n = len(PROMPT_LENGTHS)
    input_ids = torch.full((n, length), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    loss_mask = torch.zeros((n, length), dtype=torch.float32)
    for i, (prompt_len, completion_len) in enumerate(zip(PROMPT_LENGTHS, COMPLETION_LENGTHS)):
        completion = torch.randint(first_regular, BYTE_VOCAB_SIZE, (completion_len,), generator=generator)
        if ENDS_WITH_EOS[i]:
            completion[-1] = EOS_ID
        total = prompt_len + completion_len
        input_ids[i, :prompt_len] = prompts[i // GROUP_SIZE]
        input_ids[i, prompt_len:total] = completion
        attention_mask[i, :total] = 1
        loss_mask[i, prompt_len:total] = 1.0
    return Fixture(input_ids, attention_mask, loss_mask, torch.tensor(REWARDS, dtype=torch.float32))


NUM_ACTIONS = 7
"""MiniGrid's Discrete(7)."""
VLA_INSTRUCTION_LENGTHS = (18, 18, 18, 18, 26, 26, 26, 26)
"""Prompt = 49 image tokens + an instruction of this many tokens; one group per instruction."""
VLA_HAS_ACTION = (True, True, True, True, True, True, False, False)
"""The last two rows are the empty rows an env rollout pads with (no loss token): on 2 ranks rank 0 holds
4 action tokens and rank 1 only 2, so token-mean needs the global count here too."""
VLA_REWARDS = (1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.0)


def build_vla_fixture(image_token_id: int, num_image_tokens: int, action_ids: list[int]) -> Fixture:
    """8 per-step rows of an env rollout: image tokens + instruction + one action token, random images."""
    generator = torch.Generator().manual_seed(SEED)
    first_regular, last_regular = len(SPECIAL_TOKENS), min(action_ids)
    n = len(VLA_INSTRUCTION_LENGTHS)
    length = num_image_tokens + max(VLA_INSTRUCTION_LENGTHS) + 1
    input_ids = torch.full((n, length), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    loss_mask = torch.zeros((n, length), dtype=torch.float32)
    vocab = torch.tensor(action_ids)
    for i, words in enumerate(VLA_INSTRUCTION_LENGTHS):
        prompt = torch.cat([torch.full((num_image_tokens,), image_token_id),
                            torch.randint(first_regular, last_regular, (words,), generator=generator)])
        action = vocab[torch.randint(0, len(action_ids), (1,), generator=generator)]
        row = torch.cat([prompt, action]) if VLA_HAS_ACTION[i] else prompt
        input_ids[i, :len(row)] = row
        attention_mask[i, :len(row)] = 1
        if VLA_HAS_ACTION[i]:
            loss_mask[i, len(prompt)] = 1.0
    pixel_values = torch.randn((n, 3, 56, 56), generator=generator)
    return Fixture(input_ids, attention_mask, loss_mask, torch.tensor(VLA_REWARDS, dtype=torch.float32),
                   pixel_values, vocab.expand(n, -1).clone())


def vla_fixture() -> Fixture:
    """The VLA fixture for the `tiny_llava` preset and MiniGrid's 7 actions."""
    from ..models.vla import load_processor, preset_config, action_token_ids
    from ..spec import ModelSpec

    model = ModelSpec(preset="tiny_llava", kind="vla")
    config = preset_config(model.preset)
    ids = action_token_ids(load_processor(model).tokenizer, NUM_ACTIONS)
    return build_vla_fixture(config.image_token_id, config.image_seq_length, ids)


def dump_fixture(directory: Path, fixture: Fixture, specs: dict) -> None:
    """Write `fixture/`: the initial model (`save_pretrained`), the batch, and each case's algorithm section."""
    import dataclasses

    from ..models.factory import load_model, load_tokenizer, save_hf

    directory.mkdir(parents=True, exist_ok=True)
    fixture.save(directory)
    first = next(iter(specs.values()))
    save_hf(load_model(first.model, first.algorithm.seed), load_tokenizer(first.model), directory / "model")
    algorithms = {}
    for name, spec in specs.items():
        section = dataclasses.asdict(spec.algorithm)
        section["rollout"] = {"max_new_tokens": spec.rollout.max_new_tokens, "temperature": spec.rollout.temperature}
        section["lora"] = dataclasses.asdict(spec.model.lora)
        algorithms[name] = section
    (directory / "algorithm.json").write_text(json.dumps(algorithms, indent=2) + "\n")
