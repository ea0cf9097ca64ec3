"""The `hf` rollout engine: batched sampling with transformers' `generate`."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor
from transformers import GenerationConfig

from ..batch import TrainBatch
from ..policy import batch_logprobs
from ..spec import RolloutSpec, SpecError
from .base import Rollout


class HFEngine:
    """Samples with a transformers causal LM; can share its module with a colocated trainer."""

    def __init__(self, model: torch.nn.Module, tokenizer, rollout: RolloutSpec, device: torch.device | str,
                 micro_batch_size: int = 8) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.spec = rollout
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.generation_config = GenerationConfig(
            do_sample=True, temperature=rollout.temperature, top_p=rollout.top_p, top_k=0,
            max_new_tokens=rollout.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, return_dict_in_generate=True, output_logits=True)

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int, seed: int) -> Rollout:
        encoded = [self.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        for text, ids in zip(prompts, encoded):
            if len(ids) > self.spec.max_prompt_tokens:
                raise SpecError("rollout.max_prompt_tokens", f"a prompt has {len(ids)} tokens (> {self.spec.max_prompt_tokens}): "
                                f"{text[:60]!r}...", "raise rollout.max_prompt_tokens or shorten the task's prompts")
        prompt_ids = [ids for ids in encoded for _ in range(n)]
        width = max(len(ids) for ids in prompt_ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], device=self.device)
        was_training = self.model.training
        self.model.eval()
        torch.manual_seed(seed)
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                  generation_config=self.generation_config)
        self.model.train(was_training)
        new_tokens = out.sequences[:, width:].cpu()
        logprobs = torch.stack(out.logits, dim=1).float().div(self.spec.temperature).log_softmax(-1)
        picked = logprobs.gather(-1, new_tokens.to(logprobs.device).unsqueeze(-1)).squeeze(-1).cpu()
        completions, completion_logprobs, texts = [], [], []
        vocab = len(self.tokenizer)
        for row, row_logp in zip(new_tokens.tolist(), picked.tolist()):
            end = row.index(self.tokenizer.eos_token_id) + 1 if self.tokenizer.eos_token_id in row else len(row)
            completions.append(row[:end])
            completion_logprobs.append(row_logp[:end])
            texts.append(self.tokenizer.decode([t for t in row[:end] if t < vocab], skip_special_tokens=True))
        return Rollout(prompt_ids, completions, completion_logprobs, texts)

    def logprobs(self, batch: TrainBatch) -> Tensor:
        return batch_logprobs(self.model, batch, self.spec.temperature, self.micro_batch_size, self.device)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self.copy_into(self.model, named_tensors)

    @staticmethod
    @torch.no_grad()
    def copy_into(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy tensors into `model`'s weights by state-dict name (cast to each weight's device and dtype)."""
        params = model.state_dict(keep_vars=True)  # tied weights appear under both names
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"engine has no weight named {name!r}")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    def receive(self, fn, payload) -> None:
        """Run a sync transport's engine half, `fn(self, payload)`, here."""
        fn(self, payload)

    def named_weights(self) -> Iterable[tuple[str, Tensor]]:
        return self.model.state_dict().items()
