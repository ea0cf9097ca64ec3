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

from ..batch import TrainBatch
from ..grpo import group_advantages
from ..models import BYTE_VOCAB_SIZE, SPECIAL_TOKENS
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

    def train_batch(self, algo: AlgorithmSpec) -> TrainBatch:
        """A fresh `TrainBatch` with the advantages `algo` prescribes (the step template fills in the rest)."""
        advantages = group_advantages(self.rewards, algo.group_size, algo.adv_norm, algo.adv_eps)
        return TrainBatch(input_ids=self.input_ids.clone(), attention_mask=self.attention_mask.clone(),
                          loss_mask=self.loss_mask.clone(), advantages=advantages, rewards=self.rewards.clone())

    def tensors(self) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "loss_mask": self.loss_mask,
                "rewards": self.rewards}

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


def dump_fixture(directory: Path, fixture: Fixture, specs: dict) -> None:
    """Write `fixture/`: the initial model (`save_pretrained`), the batch, and each case's algorithm section."""
    import dataclasses

    from ..models import load_model, load_tokenizer, save_hf

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
