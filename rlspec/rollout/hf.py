"""The `hf` rollout engine: batched sampling with a transformers causal LM and a KV cache.

The sampling loop is rlspec's own rather than `generate()`: it keeps only the sampled token's log-prob
at each step (returning all logits, as `generate(output_logits=True)` does, costs batch x length x
vocabulary floats — 30 GB for 128 x 256 tokens of a 152k vocabulary), and it defines the engine's
log-probs exactly as the trainer's: log_softmax(logits / temperature) of the sampled token, before
top-p truncation.

On CUDA (with `rollout.cuda_graph`, for the decoders of `rlspec.rollout.architecture` without LoRA: Llama-style,
Qwen3, Gemma 2/3) sampling runs through `rlspec.rollout.static.GraphSampler`: a slot-indexed KV cache and the
decode step captured in CUDA graphs, with continuous batching (`rollout.continuous_batching`,
`rollout.decode_slots`) and one prefill per prompt; a greedy request (`SampleOptions.greedy`) too, at temperature
0. Elsewhere, for any other model (the engine says so once, at start), and for a request that asks for the top
log-probs of each step (`SampleOptions`, sent by a rollout server's OpenAI routes), the plain loop below runs. Both draw sample i's
noise keyed by (seed, i, position) (`rlspec.rollout.noise`), not from a generator shared by the batch: a sample's
tokens do not depend on the batch it ran in, so a step split over several engines samples what one engine does.
"""

from __future__ import annotations

import copy
import sys
from typing import Callable, Iterable

import torch
from torch import Tensor

from ..core.batch import TrainBatch, position_ids
from ..core.policy import batch_logprobs
from ..models.base import cache_keyword
from ..models.factory import copy_weights
from ..spec import RolloutSpec, SpecError
from .base import Rollout
from .noise import sample_keys
from .sampling import SampleOptions, next_token


def prompt_token_ids(tokenizer, prompts: list[str] | list[list[int]], max_prompt_tokens: int) -> list[list[int]]:
    """Each prompt's token ids: text tokenised, ids taken as they are; `SpecError` for one past `max_prompt_tokens`."""
    from ..serve.chat import encode

    encoded = [encode(tokenizer, p) if isinstance(p, str) else list(p) for p in prompts]
    for text, ids in zip(prompts, encoded):
        if len(ids) > max_prompt_tokens:
            raise SpecError("rollout.max_prompt_tokens", f"a prompt has {len(ids)} tokens (> {max_prompt_tokens}): "
                            f"{text[:60]!r}...", "raise rollout.max_prompt_tokens or shorten the task's prompts")
    return encoded


class HFEngine:
    """Samples with a transformers causal LM; can share its module with a colocated trainer.

    `free_during_train` (`rollout.free_during_train`; a rollout server passes none) says what the engine gives back
    after each `generate`, for the train phase: `kv_cache`, in an engine that is alone in its process
    (`own_process`), hands its allocator's cached blocks (the K/V caches and graph pools just dropped) back to the
    device; `kv_cache_and_weights` also frees its weights' storage, allocated again (uninitialised) by the next call
    that writes weights (`load_weights`, `receive`, `named_weights`: a push), and refused until then."""

    def __init__(self, model: torch.nn.Module, tokenizer, rollout: RolloutSpec, device: torch.device | str,
                 micro_batch_size: int = 8, free_during_train: str = "none", own_process: bool = False) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.spec = rollout
        self.device = torch.device(device)
        self.micro_batch_size = micro_batch_size
        self.free_during_train = free_during_train
        self.own_process = own_process
        self._freed: list[tuple[torch.UntypedStorage, int]] | None = None
        self._graph_sampler = None
        kind = self.sampler_kind()
        if kind.startswith("plain (") and self.device.type == "cuda" and rollout.cuda_graph:
            print(f"rlspec: rollout engine: {kind[len('plain ('):-1]}; generation takes the plain transformers loop "
                  "(HF's forward, no CUDA graphs)", file=sys.stderr, flush=True)

    def encode(self, prompts: list[str] | list[list[int]], n: int) -> tuple[list[list[int]], Tensor, Tensor]:
        """Each prompt's token ids `n` times, and the left-padded batch (`input_ids`, `attention_mask`) on the device.
        A prompt is text or token ids (taken as they are: a chat turn's ids hold the model's earlier sampled ids)."""
        encoded = prompt_token_ids(self.tokenizer, prompts, self.spec.max_prompt_tokens)
        prompt_ids = [ids for ids in encoded for _ in range(n)]
        width = max(len(ids) for ids in prompt_ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], device=self.device)
        return prompt_ids, input_ids, attention_mask

    @torch.no_grad()
    def generate(self, prompts: list[str] | list[list[int]], n: int, seed: int,
                 options: SampleOptions | None = None, first_sample: int = 0,
                 stop: Callable[[], bool] | None = None, free: bool = True) -> Rollout:
        """`n` completions per prompt; `options` (greedy, top log-probs) take the plain loop. `stop`: asked before
        each token of the plain loop; true ends the rollout there (a server's request whose client went away).
        Without `free` the engine keeps what `free_during_train` gives back after a rollout (a step's rollout in
        several calls, the queue of `rlspec.cluster.dispatch`, calls `free_memory` once after the last).

        Sample i of this call draws its noise as sample `first_sample + i` of `seed` (`rlspec.rollout.noise`): a
        step split over several engines sends each part with the index of its first sample, so every sample is
        the same whichever engine ran it and however the step was split."""
        options = options or SampleOptions()
        self._check_weights()
        prompt_ids, input_ids, attention_mask = self.encode(prompts, n)
        was_training = self.model.training
        self.model.eval()
        top = None
        try:
            sampler = None if options.top_logprobs else self._fast_sampler()
            if sampler is None:
                tokens, logps, top = self._sample(input_ids, attention_mask, seed, options, first_sample, stop)
            else:
                slots = self.spec.decode_slots if self.spec.continuous_batching else None
                temperature = 0.0 if options.greedy else self.spec.temperature  # the sampler's greedy decoding
                tokens, logps = sampler.sample(input_ids, attention_mask, seed, self.spec.max_new_tokens,
                                               temperature, self.spec.top_p, self.tokenizer.eos_token_id,
                                               slots=slots, first_sample=first_sample)
        finally:
            self.model.train(was_training)
            if free:
                self.free_memory(keep_weights=options.keep_weights)
        completions, completion_logprobs, texts, tops = [], [], [], []
        vocab, eos = len(self.tokenizer), self.tokenizer.eos_token_id
        for i, (row, row_logp) in enumerate(zip(tokens.tolist(), logps.tolist())):
            end = row.index(eos) + 1 if eos in row else len(row)
            completions.append(row[:end])
            completion_logprobs.append(row_logp[:end])
            texts.append(self.tokenizer.decode([t for t in row[:end] if t < vocab], skip_special_tokens=True))
            if top is not None:
                tops.append([list(zip(ids, lps)) for ids, lps in zip(top[0][i, :end].tolist(), top[1][i, :end].tolist())])
        return Rollout(prompt_ids, completions, completion_logprobs, texts, top_logprobs=tops if top is not None else None)

    def with_spec(self, spec: RolloutSpec) -> "HFEngine":
        """This engine sampling with other settings (a server request's max_tokens, temperature, top_p): the
        same model and the same CUDA-graph sampler, whose compiled blocks are then built once, not per request."""
        self._fast_sampler()
        view = copy.copy(self)
        view.spec = spec
        return view

    def sampler_kind(self) -> str:
        """How this engine samples: `cuda_graph`, or `plain (<why>)` (reported by a rollout server's `/health`)."""
        if self.device.type != "cuda":
            return "plain (not on CUDA)"
        if not self.spec.cuda_graph:
            return "plain (rollout.cuda_graph is false)"
        from .architecture import unsupported_reason

        reason = unsupported_reason(self.model)
        return f"plain ({reason})" if reason else "cuda_graph"

    def _fast_sampler(self):
        """The CUDA-graph sampler when it can run this model here, else None (the plain loop)."""
        if self.device.type != "cuda" or not self.spec.cuda_graph:
            return None
        from .architecture import unsupported_reason
        from .static import GraphSampler

        if self._graph_sampler is None and unsupported_reason(self.model) is None:
            self._graph_sampler = GraphSampler(self.model, self.device)
        return self._graph_sampler

    def _sample(self, input_ids: Tensor, attention_mask: Tensor, seed: int, options: SampleOptions,
                first_sample: int = 0, stop: Callable[[], bool] | None = None
                ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
        """[B, T] sampled tokens and their log-probs, and with `options.top_logprobs` the [B, T, k] ids and
        log-probs of the k most likely tokens; rows that ended carry the end token onward (cut later).
        Row i's noise is keyed by (seed, first_sample + i, position), as in the CUDA-graph sampler."""
        from transformers import DynamicCache

        keys = sample_keys(seed, torch.arange(first_sample, first_sample + input_ids.shape[0], device=self.device))
        eos, temperature = self.tokenizer.eos_token_id, self.spec.temperature
        positions = position_ids(attention_mask)
        cache = {cache_keyword(self.model): DynamicCache()}
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                            use_cache=True, **cache).logits[:, -1]
        next_position = positions[:, -1:] + 1
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=self.device)
        tokens, logps, top_ids, top_logps = [], [], [], []
        for t in range(self.spec.max_new_tokens):
            token, logp = next_token(logits, temperature, self.spec.top_p, keys, t, options.greedy)
            token = torch.where(done, torch.full_like(token, eos), token)
            tokens.append(token)
            logps.append(logp.gather(-1, token.unsqueeze(-1)).squeeze(-1))
            if options.top_logprobs:
                best = logp.topk(min(options.top_logprobs, logp.shape[-1]), dim=-1)
                top_logps.append(best.values)
                top_ids.append(best.indices)
            done |= token == eos
            if bool(done.all()) or (stop is not None and stop()):
                break
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=-1)
            logits = self.model(input_ids=token.unsqueeze(-1), attention_mask=attention_mask, position_ids=next_position,
                                use_cache=True, **cache).logits[:, -1]
            next_position = next_position + 1
        top = (torch.stack(top_ids, dim=1).cpu(), torch.stack(top_logps, dim=1).cpu()) if top_ids else None
        return torch.stack(tokens, dim=1).cpu(), torch.stack(logps, dim=1).float().cpu(), top

    def logprobs(self, batch: TrainBatch) -> Tensor:
        self._check_weights()
        return batch_logprobs(self.model, batch, self.spec.temperature, self.micro_batch_size, self.device)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self.restore_weights()
        copy_weights(self.model, named_tensors)

    def receive(self, fn, payload):
        """Run a sync transport's engine half, `fn(self, payload)`, here; return what it returns (its timings)."""
        self.restore_weights()
        return fn(self, payload)

    def named_weights(self) -> Iterable[tuple[str, Tensor]]:
        self.restore_weights()
        return self.model.state_dict().items()

    def free_memory(self, keep_weights: bool = False) -> None:
        """After a rollout: what `free_during_train` gives back (class docstring); the weights stay with
        `keep_weights` (an eval's call)."""
        if self.free_during_train == "kv_cache_and_weights" and self._freed is None and not keep_weights:
            # Each storage resized to nothing, not replaced: tensors a transport keeps of the weights (cuda_ipc's
            # receiver holds views of them across pushes) stay views of the same storage when it is resized back.
            storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in self.model.parameters()}
            self._freed = [(storage, storage.nbytes()) for storage in storages.values()]  # tied weights once
            for storage, _ in self._freed:
                storage.resize_(0)
        if self.free_during_train != "none" and self.own_process and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def restore_weights(self) -> None:
        """Storage for weights `free_memory` freed, uninitialised: the caller (a push) writes every one."""
        if self._freed is None:
            return
        for storage, nbytes in self._freed:
            storage.resize_(nbytes)
        self._freed = None

    def _check_weights(self) -> None:
        if self._freed is not None:
            raise RuntimeError("the rollout engine's weights were freed for the train phase "
                               "(rollout.free_during_train=kv_cache_and_weights) and no push has restored them")
