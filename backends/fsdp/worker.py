"""One FSDP2 trainer rank, run as a Ray actor (the driver side is `backend.py`).

Every rank builds the same initial model (`rlspec.models.factory.load_model` with the plan's seed), adds LoRA
adapters when `model.lora.r > 0` (`rlspec.models.factory.apply_lora`), shards it with
`torch.distributed.fsdp.fully_shard` (each block named in the model's `_no_split_modules`, then the
root) over a 1-D device mesh, and runs the shared micro-batch loop `rlspec.core.policy.accumulate` on its
shard. Parameters are sharded fp32 masters; forward and backward run in `model.dtype`
(`MixedPrecisionPolicy`), gradients are reduced in fp32. Anything that touches sharded parameters
(forward, gather, save) is collective: the driver always calls all ranks together.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from ...cluster.ray_group import RankWorker, sharded_logprobs
from ...core.batch import TrainBatch
from ...core.grpo import LossConfig, LossNorm
from ...core.policy import CompiledBlocks, accumulate, block_classes
from ...core.shards import gather_flat, step_on_shards
from ...core.trainer import build_optimizer, grad_norm_and_clip, merged_weights
from ...core.weights import gather_groups, tied_aliases, untied
from ...models.base import DTYPES, checkpoint_activations
from ...models.factory import apply_lora, load_model, load_tokenizer, read_safetensors_dir, save_gathered
from ...runtime.checkpoints import ADAM_KEYS, MASTER_KEY, read_optimizer_state, write_optimizer_state
from ...runtime.rng import load_rng_state, save_rng_state, seed_rank
from ...runtime.metrics import gpu_used_gb
from ...spec import RunPlan

STATE_DIR = "optimizer_dcp"
"""`torch.distributed.checkpoint` of the sharded fp32 parameters and optimizer state inside a save (LoRA only)."""
PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)


def shard_model(model: torch.nn.Module, mesh, param_dtype: torch.dtype, offload: bool,
                reshard_after_forward: bool = True) -> torch.nn.Module:
    """`fully_shard` every block (innermost first), then the root, which is the module the loss calls.
    (FSDP2 never reshards the root after its forward: its parameters are needed first in the backward.)

    On a one-rank mesh without resharding, the root alone: per-block units then neither save memory (every
    block stays gathered) nor overlap a gather with compute (there is nothing to exchange), and each costs its
    own gather, gradient reduction and hooks in Python, which on one GPU held the train step back.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    names = block_classes(model)
    if not names:
        raise RuntimeError(f"{type(model).__name__} names no _no_split_modules: no blocks to shard one by one")
    options = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
                   offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    if reshard_after_forward or mesh.size() > 1:
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        for block in reversed(blocks):  # modules() lists parents first; nested blocks are sharded before their parent
            fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, **options)
    return model


class FSDPWorker(RankWorker):
    """Trainer rank `rank` of `world_size`."""

    def __init__(self, plan: RunPlan, rank: int, world_size: int, fault: str | None = None) -> None:
        super().__init__(plan, rank, world_size, fault)
        self.model = None
        self.reference = None
        self.compiled = None
        self.reshard = True
        self.units: list = []
        """The FSDP2 units of the policy (each block, then the root; the root alone on one rank by default)."""
        self.trained = False
        self.aliases: frozenset[str] | None = None
        """`tied_aliases` of the policy, taken at its first push."""

    def setup(self, master: tuple[str, int]) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        spec = self.plan.spec
        self.device = self.place()
        cuda = self.device.type == "cuda"
        # On CUDA, gloo beside NCCL for collectives on host tensors: with CPUOffloadPolicy the gradients, and
        # so the grad-norm reduction, live on the host.
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"tcp://{master[0]}:{master[1]}",
                                rank=self.rank, world_size=self.world_size, timeout=PROCESS_GROUP_TIMEOUT,
                                device_id=self.device if cuda else None)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.dtype = DTYPES[spec.model.dtype]
        # CPUOffloadPolicy keeps sharded parameters, gradients and the optimizer step on the host, so
        # FSDP2 offloads the optimizer only together with the parameters: either flag turns it on.
        offload = cuda and (spec.hardware.offload_params or spec.hardware.offload_optimizer)
        self.loss_cfg = LossConfig.from_algorithm(spec.algorithm)
        self.tokenizer = load_tokenizer(spec.model) if self.rank == 0 else None

        model = load_model(spec.model, spec.algorithm.seed, self.device)
        seed_rank(spec.algorithm.seed, self.rank)  # dropout draws from here (`rlspec.runtime.rng`)
        if spec.model.gradient_checkpointing:
            checkpoint_activations(model)
        # fp32 master parameters (exact for a bf16 start); MixedPrecisionPolicy computes in model.dtype.
        model = apply_lora(model.float(), spec.model, spec.algorithm.seed)
        self.reshard = self.plan.sharding.reshard_after_forward
        self.model = shard_model(model, mesh, self.dtype, offload, self.reshard)  # moves the shards to the mesh's device
        if cuda:  # the 16-bit initial weights (built on the device) and the unsharded copies stay cached otherwise:
            torch.cuda.empty_cache()  # 15 GB of the 7B shape that a colocated engine needs
        self.units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        # After sharding: transformers wraps the forward of FSDP2's block subclass again, and only the outermost
        # wrapper applies gradient checkpointing, so the forward to compile is the sharded class's.
        self.compiled = CompiledBlocks(self.model, spec.model.compile_layers)
        self.model.train()
        self.optimizer = build_optimizer(self.model.parameters(), spec.algorithm)
        if self.plan.needs_reference_model:
            reference = load_model(spec.model, spec.algorithm.seed, self.device).eval().requires_grad_(False)
            self.reference = shard_model(reference, mesh, self.dtype, offload)

    # --- the training step -------------------------------------------------------------------------

    def prepare_update(self) -> None:
        """While the engines sample: gather the parameters for the next update now, where they stay gathered
        through the whole update anyway (`hardware.fsdp.reshard_after_forward` false, one rank's default), so its
        first forward finds them ready; off with `hardware.fsdp.gather_during_rollout=false`. On one GPU that
        gather is host work per parameter (a cast and a copy each) that otherwise opens the train phase with the
        GPU idle. Nothing changes the sharded parameters between here and the update; reading or writing the
        weights (push, save, load) shards them again first (`_sharded`).

        Only after a first update: FSDP2 sets up its streams in the first forward."""
        if self.reshard or not self.trained or not self.plan.spec.hardware.fsdp.gather_during_rollout:
            return
        for unit in self.units:
            unit.unshard()

    def _sharded(self) -> None:
        """Free gathered parameters (from `prepare_update`) so the module holds its sharded ones again."""
        for unit in self.units:
            unit.reshard()

    def logprobs(self, part: TrainBatch, num_chunks: int, reference: bool) -> Tensor:
        """Log-probs of this rank's part in exactly `num_chunks` forwards (FSDP gathers are collective)."""
        model = self.reference if reference else self.model
        if model is None:
            raise RuntimeError("no reference model: algorithm.kl_coef is 0")
        return sharded_logprobs(model, part, num_chunks, self.plan.batch.micro_batch_size,
                                self.plan.spec.rollout.temperature, self.device)

    def forward_backward(self, shard: TrainBatch, norm: LossNorm, sizes: list[int] | None = None) -> dict[str, float]:
        """Forward + backward over `shard` in micro-batches of `sizes` sequences (default `micro_batch_size`
        each); every rank runs as many (see `rlspec.core.packing.plan_split`)."""
        self.maybe_fail()
        self.tracer.begin("train")  # through optimizer_step (`rlspec.perf.rank_trace`)

        def backward(loss: Tensor) -> None:
            # The loss share is normalised by global counts (LossNorm); FSDP averages gradients over the
            # ranks, so undo that with x world size.
            (loss * self.world_size).backward()

        def boundary(last: bool) -> None:
            # Gradients are reduce-scattered once, after the last micro-batch; before that each rank accumulates
            # its unsharded gradients. Blocks kept gathered through the backward (no reshard after forward) stay
            # gathered until the last micro-batch's backward too: the parameters do not change within a step,
            # and gathering them again for each micro-batch was most of FSDP2's host time per step on one GPU.
            self.model.set_requires_gradient_sync(last)
            if not self.reshard:
                self.model.set_reshard_after_backward(last)

        with self.compiled.active():
            stats = accumulate(self.model, shard, self.plan.batch.micro_batch_size, norm, self.loss_cfg,
                               self.plan.spec.rollout.temperature, backward, self.device, sizes, boundary=boundary)
        self.trained = True
        if self.device.type == "cuda":
            stats["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            stats["gpu_used_gb"] = gpu_used_gb(self.device)
        return stats

    def optimizer_step(self) -> float:
        """Clip at `algorithm.max_grad_norm` (0 = off), step, zero; the global grad norm before clipping."""
        norm = grad_norm_and_clip(self.model.parameters(), self.plan.spec.algorithm.max_grad_norm)
        step_on_shards(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.tracer.end("train")
        return float(norm)

    # --- weights -------------------------------------------------------------------------------------

    def full_weights(self, keep: bool) -> Iterator[tuple[str, Tensor]]:
        """Full weights by HF state-dict name (LoRA merged, a tied weight under its first name only) in
        `model.dtype`.

        Gathered a bucket (`sync.bucket_mb`, or one larger tensor) at a time on every rank, grouped as the
        transports bucket them: one all-gather of a group gives its full tensors side by side in one fresh buffer
        (`gather_flat`), which a bucketing transport sends as that bucket without another copy. A group holds the
        rank's shards, every rank's and the full tensors at once, so the extra memory is about two buckets, not
        the model. An all-gather leaves the full tensors on every rank: each rank yields them (a colocated rank
        feeds the engine beside it from its own copy); `keep` changes nothing.
        """
        self._sharded()
        if self.aliases is None:  # the model's ties do not change: walked once, not at every push
            self.aliases = tied_aliases(self.model)
        for group in gather_groups(untied(merged_weights(self.model, detach=False), self.aliases),
                                   self.plan.spec.sync.bucket_mb << 20,
                                   lambda t: t.numel() * self.dtype.itemsize):
            yield from self._gather(group)

    def _gather(self, pending: list[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """All-gather `pending` (emptied) in one collective (`gather_flat`), cast to `model.dtype` first."""
        full = gather_flat(pending, self.dtype)
        pending.clear()
        full.reverse()
        while full:  # drop each tensor from this frame once it is handed over
            yield full.pop()

    def save(self, path: str, save_optimizer: bool) -> None:
        """HF safetensors directory (rank 0) + the portable optimizer state by parameter name
        (`rlspec.runtime.checkpoints`), which any backend at any rank count resumes. With LoRA, the sharded
        parameters and optimizer state instead (`torch.distributed.checkpoint`, one file per rank: fsdp alone
        resumes it)."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self.run_sender(save_gathered, (base, self.tokenizer, Path(path)))  # rank 0 writes the full weights
        save_rng_state(Path(path), self.rank)
        if not save_optimizer:
            return
        if hasattr(self.model, "peft_config"):
            import torch.distributed.checkpoint as dcp

            dcp.save(self._state(), checkpoint_id=str(Path(path) / STATE_DIR))
            return
        tensors, step = self._portable_state()
        if self.rank == 0:
            write_optimizer_state(Path(path), tensors, self.plan.spec.algorithm.optimizer, step)

    def _portable_state(self) -> tuple[dict[str, Tensor], int]:
        """Full optimizer state by parameter name (and fp32 masters below fp32 weights), on rank 0 (collective)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors on rank 0 only
        state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        tensors, step = {}, 0
        for name, entry in state.get("state", {}).items():
            tensors.update({f"{name}.{key}": entry[key] for key in ADAM_KEYS if key in entry})
            step = int(entry.get("step", step))
        if self.dtype != torch.float32:
            trained = {name for name, p in self.model.named_parameters() if p.requires_grad}
            masters = get_model_state_dict(self.model, options=options)
            tensors.update({f"{name}.{MASTER_KEY}": t for name, t in masters.items() if name in trained})
        return tensors, step

    def load(self, path: str) -> None:
        """Resume from a checkpoint of any backend: the portable optimizer state (`rlspec.runtime.checkpoints`)
        and the fp32 masters where saved, else the safetensors weights; with LoRA, `STATE_DIR` when present.
        Without optimizer state (saved with `checkpoint.save_optimizer=false`): the weights, a fresh optimizer
        (with LoRA the merged weights go into the base and the adapters start again at B = 0)."""
        load_rng_state(Path(path), self.rank)
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict, set_state_dict)

        self._sharded()
        state_dir = Path(path) / STATE_DIR
        if state_dir.is_dir():
            import torch.distributed.checkpoint as dcp

            state = self._state()
            dcp.load(state, checkpoint_id=str(state_dir))
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
            return
        saved = read_optimizer_state(Path(path))
        tensors, step = saved if saved is not None else ({}, 0)
        weights = read_safetensors_dir(Path(path))
        current = self.model.state_dict()
        names = {_hf_name(key): key for key in current if "lora_" not in key}
        full = {names[name]: tensor for name, tensor in weights.items() if name in names}
        full.update({key: tensors[f"{key}.{MASTER_KEY}"] for key in current if f"{key}.{MASTER_KEY}" in tensors})
        # The saved weights are merged: B = 0 makes the adapted model compute exactly them.
        full.update({key: torch.zeros(value.shape, dtype=value.dtype) for key, value in current.items() if ".lora_B." in key})
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, strict=False))
        if not any(key.endswith(f".{ADAM_KEYS[0]}") for key in tensors):
            return
        trained = [name for name, p in self.model.named_parameters() if p.requires_grad]
        groups = [{key: value for key, value in group.items() if key != "params"} | {"params": trained}
                  for group in self.optimizer.param_groups]  # build_optimizer makes one group
        state = {name: {"step": torch.tensor(float(step)), **{key: tensors[f"{name}.{key}"] for key in ADAM_KEYS}}
                 for name in trained if f"{name}.{ADAM_KEYS[0]}" in tensors}
        set_optimizer_state_dict(self.model, self.optimizer, {"state": state, "param_groups": groups},
                                 options=StateDictOptions(full_state_dict=True))

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optim_state}


def _hf_name(key: str) -> str:
    """The base model's name of a (possibly PEFT-wrapped) state-dict key."""
    return key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def export_footprint(named, payload: dict) -> dict:
    """A sender function that measures the export instead of sending it: drains `named` (dropping each
    tensor) while a thread samples this process's resident memory every `payload["interval_s"]`.

    glibc would serve a freed bucket's memory again without it ever leaving the process (resident memory
    would not see a second bucket), so first every allocation from 64 KiB up is made its own mapping, returned
    to the system when freed, and free heap memory is trimmed: resident growth then follows live tensors.
    Returns the peak resident growth over the start, the bytes exported and the largest tensor's bytes;
    `run_sender(export_footprint, {"interval_s": 0.001})` runs it on trainer rank 0 (Linux with glibc).
    """
    import ctypes
    import threading
    import time

    import psutil

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD: fixed, so no longer raised by each free
    libc.malloc_trim(0)
    process = psutil.Process()
    start = process.memory_info().rss
    peak = [start]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(payload["interval_s"])

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    total = largest = 0
    try:
        for _, tensor in named:
            nbytes = tensor.numel() * tensor.element_size()
            total += nbytes
            largest = max(largest, nbytes)
            del tensor
    finally:
        stop.set()
        thread.join()
    return {"peak_rss_growth_bytes": peak[0] - start, "exported_bytes": total, "largest_tensor_bytes": largest}
