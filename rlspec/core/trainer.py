"""The plain single-process torch trainer.

It is the standalone backend's trainer and the reference the conformance suite compares every other
backend against: fp32, no sharding, gradients accumulated over micro-batches with the shared loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from ..models.base import checkpoint_activations
from ..models.factory import apply_lora, copy_weights, load_model, load_tokenizer, read_safetensors_dir, save_hf
from ..runtime.checkpoints import ADAM_KEYS, read_optimizer_state, write_optimizer_state
from ..runtime.rng import load_rng_state, save_rng_state, seed_rank
from ..spec import AlgorithmSpec, ModelSpec
from .batch import TrainBatch
from .grpo import LossConfig, LossNorm
from .policy import CompiledBlocks, accumulate, batch_logprobs
from .shards import sharded_grad_norm_and_clip
from .weights import state_items, tied_aliases, untied

OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_DIR = "adapter"


def build_optimizer(params, algo: AlgorithmSpec, fused: bool | None = None) -> torch.optim.Optimizer:
    """The policy optimizer, from the spec (shared by every backend that uses a torch optimizer). `fused`: AdamW's
    fused kernel; None: where every parameter is on CUDA now. A wrapper that hands the optimizer other tensors to
    step (DeepSpeed's fp32 partitions, made on the rank's device from CPU parameters) says where they will live:
    torch checks the device at the first step, not here."""
    params = [p for p in params if p.requires_grad]
    if algo.optimizer == "sgd":
        return torch.optim.SGD(params, lr=algo.lr, weight_decay=algo.weight_decay)
    # Fused kernels on CUDA (one launch per group of tensors, no per-step host work), where a loop over
    # tensors launches thousands of small kernels per step; the per-tensor loop on CPU, which the
    # conformance tolerances were measured with.
    cuda = _on_cuda(params) if fused is None else fused
    return torch.optim.AdamW(params, lr=algo.lr, betas=(algo.adam_beta1, algo.adam_beta2), eps=algo.adam_eps,
                             weight_decay=algo.weight_decay, foreach=False, fused=cuda or None)


def _on_cuda(params) -> bool:
    """Whether every parameter is on CUDA (where fused and multi-tensor kernels pay)."""
    return bool(params) and all(p.is_cuda for p in params)


def grad_norm_and_clip(params, max_grad_norm: float) -> Tensor:
    """Global L2 norm of the gradients (before clipping), a 0-dim device tensor; clip in place when
    `max_grad_norm` > 0. Read it after queueing the optimizer step: reading waits for the device, whose queue is
    then empty while the host queues the step.

    Sharded (DTensor) gradients: from the local shards and one all-reduce (`rlspec.core.shards`), or where they
    do not qualify, the DTensor ops. On CUDA the multi-tensor kernels: the per-tensor loop costs a few kernels
    and, on DTensors, a dispatch per tensor.
    """
    params = [p for p in params if p.grad is not None]
    norm = sharded_grad_norm_and_clip(params, max_grad_norm)  # DTensors sharded on every mesh dimension
    if norm is not None:
        return norm
    limit = max_grad_norm if max_grad_norm > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, limit, foreach=_on_cuda(params))
    if hasattr(norm, "full_tensor"):  # a DTensor: this rank's partial norm until reduced
        norm = norm.full_tensor()
    return norm


class LocalTrainer:
    """Policy (+ optional LoRA and reference model) and optimizer in this process."""

    def __init__(self, model_spec: ModelSpec, algo: AlgorithmSpec, temperature: float, max_new_tokens: int,
                 device: torch.device | str = "cpu", needs_reference: bool = False,
                 model: torch.nn.Module | None = None) -> None:
        self.device = torch.device(device)
        self.algo = algo
        seed_rank(algo.seed, 0)  # LoRA dropout draws from here (`rlspec.runtime.rng`)
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.loss_cfg = LossConfig.from_algorithm(algo)
        self.tokenizer = load_tokenizer(model_spec)
        base = model if model is not None else load_model(model_spec, algo.seed, self.device)
        self.reference = None
        if needs_reference:
            self.reference = load_model(model_spec, algo.seed, self.device).to(self.device).eval()
            self.reference.requires_grad_(False)
        if model_spec.gradient_checkpointing:
            checkpoint_activations(base)
        self.model = apply_lora(base, model_spec, algo.seed).to(self.device)
        self.model.train()
        self.compiled = CompiledBlocks(self.model, model_spec.compile_layers)
        self.aliases = tied_aliases(self.model)
        self.optimizer = build_optimizer(self.model.parameters(), algo)

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("no reference model: algorithm.kl_coef is 0")
        return batch_logprobs(model, batch, self.temperature, self.algo.micro_batch_size, self.device)

    def forward_backward(self, batch: TrainBatch, norm: LossNorm) -> Mapping[str, float]:
        """The statistic sums stay on the device until read (`DeviceSums`): the caller queues the optimizer step
        first (`rlspec.core.step.update`)."""
        sizes = None
        if self.algo.micro_batch_tokens:
            ((batch, sizes),) = batch.token_shards(1, self.algo.micro_batch_tokens)
        with self.compiled.active():
            return accumulate(self.model, batch, self.algo.micro_batch_size, norm, self.loss_cfg, self.temperature,
                              lambda loss: loss.backward(), self.device, sizes, read_now=False)

    def optimizer_step(self) -> float:
        norm = grad_norm_and_clip(self.model.parameters(), self.algo.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full policy weights by base-model name (LoRA adapters merged in), a tied weight under its first name
        only (`tied_aliases`); without LoRA, views of the model's own tensors (`state_items`: no state-dict walk
        per sync)."""
        if hasattr(self.model, "peft_config"):
            yield from untied(merged_weights(self.model), self.aliases)
        else:
            yield from untied(state_items(self.model), self.aliases)

    def export_adapters(self) -> Iterator[tuple[str, Tensor]]:
        """The LoRA adapter tensors alone, by PEFT state-dict name (what `sync.method=lora` moves)."""
        if not hasattr(self.model, "peft_config"):
            return iter(())
        return ((k, v.detach()) for k, v in self.model.state_dict().items() if "lora_" in k)

    def save(self, path: Path, save_optimizer: bool = True) -> None:
        """Merged weights for `from_pretrained`; with LoRA also the adapters alone, which `load` resumes from."""
        save_hf(self.model, self.tokenizer, path)
        save_rng_state(path, 0)
        if hasattr(self.model, "peft_config"):
            self.model.save_pretrained(path / ADAPTER_DIR)
        if save_optimizer:
            tensors, step = local_optimizer_state(self.model, self.optimizer)
            write_optimizer_state(path, tensors, self.algo.optimizer, step)

    def load(self, path: Path) -> None:
        load_rng_state(path, 0)
        if hasattr(self.model, "peft_config"):
            # The base stays as built (same seed or directory); the adapters carry all training.
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, read_safetensors_dir(path / ADAPTER_DIR))
        else:
            copy_weights(self.model, read_safetensors_dir(path).items())
        saved = read_optimizer_state(path)
        if saved is not None:
            load_local_optimizer_state(self.model, self.optimizer, *saved)
        elif (path / OPTIMIZER_FILE).is_file():  # written by rlspec before the portable format
            self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=True))


def local_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], int]:
    """The portable optimizer state (`rlspec.runtime.checkpoints`) of an optimizer over unsharded parameters."""
    tensors, step = {}, 0
    for name, param in model.named_parameters():
        state = optimizer.state.get(param, {})
        for key in ADAM_KEYS:
            if key in state:
                tensors[f"{name}.{key}"] = state[key]
        if "step" in state:
            step = int(state["step"])
    return tensors, step


def load_local_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor],
                               step: int) -> None:
    """Put portable optimizer state back into an optimizer over unsharded parameters (by parameter name)."""
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    state = {}
    for name, param in model.named_parameters():
        if id(param) in index and f"{name}.{ADAM_KEYS[0]}" in tensors:
            state[index[id(param)]] = {"step": torch.tensor(float(step)),
                                       **{key: tensors[f"{name}.{key}"].to(param.dtype) for key in ADAM_KEYS}}
    saved = optimizer.state_dict()
    saved["state"] = state
    optimizer.load_state_dict(saved)  # moves each tensor to its parameter's device


def full_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """Base-model state dict with any LoRA adapters merged (W + B A * alpha / r), detached."""
    return dict(merged_weights(model))


def merged_weights(model: torch.nn.Module, detach: bool = True) -> Iterator[tuple[str, Tensor]]:
    """`full_state_dict`'s items one at a time, each merged weight computed when it is reached (so a
    sharded trainer can gather them bucket by bucket; on DTensor parameters the results are DTensors).

    Each tensor is detached once: `state_dict()` would detach it and a second `detach` again, and on an FSDP2
    model each is a DTensor dispatch (291 tensors of a 24-layer model on a 2-core CPU host: 23 ms for
    `state_dict()`, 1.2 ms with `keep_vars`, 22 ms for the detaches), paid at every push. `detach=False` leaves
    the model's own tensors (parameters included) as they are, for a caller that reads them without autograd
    (`rlspec.core.shards.gather_flat` takes each DTensor's local shard): no dispatch at all. A merged LoRA weight
    is computed, and detached, either way."""
    if not hasattr(model, "peft_config"):
        items = model.state_dict(keep_vars=True).items()
        yield from ((k, v.detach()) for k, v in items) if detach else items
        return
    base = model.get_base_model()
    lora = {name: module for name, module in base.named_modules()
            if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        clean = key.replace(".base_layer.", ".")
        owner, _, leaf = clean.rpartition(".")
        module = lora.get(owner)
        if module is None or leaf != "weight":
            yield clean, value.detach()
            continue
        weight = module.base_layer.weight.detach().clone()
        for adapter in module.active_adapters:
            weight += module.get_delta_weight(adapter).detach()
        yield clean, weight
