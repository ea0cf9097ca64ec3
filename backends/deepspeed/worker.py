"""One DeepSpeed ZeRO trainer rank (stage 3, 2 or 1, `hardware.deepspeed.zero_stage`), run as a Ray actor (the driver
side is `backend.py`).

Every rank builds the same initial model (`rlspec.models.factory.load_model` with the plan's seed), wraps it with
`deepspeed.initialize` and a torch optimizer from `rlspec.core.trainer.build_optimizer`, and runs the shared
micro-batch loop `rlspec.core.policy.accumulate` on its shard. ZeRO-3 partitions the weights, so anything that
touches them (forward, gather, save) is collective; ZeRO-2 keeps the full weights on every rank and partitions
only gradients and optimizer state, whose reduction in the backward and gathers on save are collective too; ZeRO-1
partitions only the optimizer state and all-reduces the whole gradient at the accumulation boundary. The driver
always calls all ranks together.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor

from ...cluster.ray_group import RankWorker, sharded_logprobs
from ...core.batch import TrainBatch
from ...core.grpo import LossConfig, LossNorm
from ...core.policy import CompiledBlocks, accumulate, block_modules
from ...core.trainer import build_optimizer
from ...core.weights import gather_groups, tied_aliases, untied
from ...models.base import checkpoint_activations
from ...models.factory import load_model, load_tokenizer, read_safetensors_dir, save_gathered
from ...runtime.checkpoints import ADAM_KEYS, MASTER_KEY, read_optimizer_state, write_optimizer_state
from ...runtime.rng import load_rng_state, save_rng_state, seed_rank
from ...runtime.metrics import gpu_used_gb
from ...spec import RunPlan

ZERO_DIR = "optimizer_zero3"
"""DeepSpeed's own checkpoint (per-rank ZeRO partitions), which rlspec wrote before the portable format: still read."""
ZERO_TAG = "state"


def ds_config(plan: RunPlan, train: bool = True) -> dict[str, Any]:
    """The DeepSpeed config, every value that matters written from the plan (DeepSpeed's defaults are not
    neutral: an omitted `gradient_clipping` clips at 1.0). ZeRO-1 and ZeRO-2 get the keys every stage reads; the
    `stage3_*` keys, parameter offload and ZeRO-3's linear only go with stage 3, which alone partitions parameters."""
    spec, batch = plan.spec, plan.batch
    dtype, knobs, stage = spec.model.dtype, spec.hardware.deepspeed, plan.sharding.zero_stage
    offload_optimizer = "cpu" if spec.hardware.offload_optimizer else "none"
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": {"device": offload_optimizer, "pin_memory": offload_optimizer == "cpu"},
        "overlap_comm": knobs.overlap_comm,
        "contiguous_gradients": knobs.contiguous_gradients,
        "reduce_scatter": True,
        "reduce_bucket_size": knobs.reduce_bucket_numel,
    }
    if stage == 3:
        offload_params = "cpu" if spec.hardware.offload_params else "none"
        zero |= {
            "offload_param": {"device": offload_params, "pin_memory": offload_params == "cpu"},
            "stage3_prefetch_bucket_size": knobs.prefetch_bucket_numel,
            "stage3_param_persistence_threshold": param_persistence_numel(spec, batch.num_trainer_ranks),
            "stage3_max_live_parameters": knobs.max_live_numel,
            "stage3_max_reuse_distance": 1_000_000_000,
            "stage3_module_granularity_threshold": knobs.module_granularity_numel,
            "memory_efficient_linear": memory_efficient_linear(spec),
            "stage3_gather_16bit_weights_on_model_save": False,
        }
    else:  # the updated weight partitions are all-gathered after each step, in buckets of this many values
        zero |= {"allgather_partitions": True, "allgather_bucket_size": ALLGATHER_BUCKET_NUMEL}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.grad_accum_steps,
        "train_batch_size": batch.micro_batch_size * batch.grad_accum_steps * batch.num_trainer_ranks,
        "gradient_clipping": float(spec.algorithm.max_grad_norm),  # 0.0 = off
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "zero_optimization": zero,
        # ZeRO-1 in bf16 runs DeepSpeed's BF16_Optimizer: each gradient is added into its fp32 accumulator by a
        # hook as the backward produces it (`immediate_grad_update`), while the device still runs the backward,
        # rather than all of them in a loop after it (290 tensors for the 0.5B shape, host-bound).
        "bf16": {"enabled": dtype == "bfloat16"} | ({"immediate_grad_update": True} if stage == 1 else {}),
        "fp16": {"enabled": dtype == "float16", "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # a torch optimizer on offloaded state: no cpu_adam JIT build
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "dump_state": False,
    }
    if dtype != "float32":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if not train:  # a frozen reference model: parameters only, no optimizer, no clipping
        for key in ("gradient_clipping", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"):
            config.pop(key)
        config["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    return config


ALLGATHER_BUCKET_NUMEL = 500_000_000
"""ZeRO-1/2's `allgather_bucket_size` (DeepSpeed's own default, written out): values per all-gather of updated
weights."""
PERSISTENCE_NUMEL = 100_000
"""`hardware.deepspeed.param_persistence_numel` where null does not mean every parameter."""


def param_persistence_numel(spec, num_ranks: int) -> int:
    """`hardware.deepspeed.param_persistence_numel`, null resolved: every parameter stays whole on one rank without
    parameter offload (the rank holds them whole anyway), else `PERSISTENCE_NUMEL`."""
    chosen = spec.hardware.deepspeed.param_persistence_numel
    if chosen is not None:
        return chosen
    return 1 << 62 if num_ranks == 1 and not spec.hardware.offload_params else PERSISTENCE_NUMEL


def memory_efficient_linear(spec) -> bool:
    """`hardware.deepspeed.memory_efficient_linear`, null resolved: off with compiled layers (see the field)."""
    chosen = spec.hardware.deepspeed.memory_efficient_linear
    return not spec.model.compile_layers if chosen is None else chosen


def gather_blocks_whole(model: torch.nn.Module) -> None:
    """Make the model's repeated blocks ZeRO-3 leaf modules: each block's parameters are gathered together when
    it starts (and again for its backward), with no ZeRO-3 hooks on its submodules. `model.compile_layers`
    needs this: a compiled block's forward then holds plain tensors and no hooks, as under FSDP2, where
    per-submodule hooks would break the graph at every linear layer."""
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, list({type(m) for m in block_modules(model, "compile")}))


class DeepSpeedWorker(RankWorker):
    """Trainer rank `rank` of `world_size`."""

    def __init__(self, plan: RunPlan, rank: int, world_size: int, fault: str | None = None) -> None:
        super().__init__(plan, rank, world_size, fault)
        self.stage = plan.sharding.zero_stage
        self.engine = None
        self.reference = None
        self.compiled = None

    def setup(self, master: tuple[str, int]) -> None:
        import warnings

        import deepspeed
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

        # DeepSpeed calls collectives by names torch 2.13 deprecated: a warning per call that no user can act on
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)

        spec = self.plan.spec
        self.device = self.place()
        cuda = self.device.type == "cuda"
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0" if cuda else str(self.rank),
                          LOCAL_WORLD_SIZE="1" if cuda else str(self.world_size))
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False,
                                   timeout=timedelta(minutes=30), rank=self.rank, world_size=self.world_size)
        self.loss_cfg = LossConfig.from_algorithm(spec.algorithm)
        self.tokenizer = load_tokenizer(spec.model) if self.rank == 0 else None
        model = load_model(spec.model, spec.algorithm.seed, self.device)
        seed_rank(spec.algorithm.seed, self.rank)  # dropout draws from here (`rlspec.runtime.rng`)
        if spec.model.gradient_checkpointing:
            checkpoint_activations(model)
        model.train()
        if spec.model.compile_layers and self.stage == 3:  # ZeRO-1/2 put no hooks on modules: nothing to gather
            gather_blocks_whole(model)
        # AdamW steps DeepSpeed's fp32 partitions, on the rank's device unless the optimizer is offloaded: fused
        # there (one kernel over the partition, where torch's per-tensor path took 8.2 ms against 4.5 for the 0.5B
        # shape on an H200).
        optimizer = build_optimizer(model.parameters(), spec.algorithm,
                                    fused=cuda and not spec.hardware.offload_optimizer)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                                 config=ds_config(self.plan))
        if cuda:  # the initial 16-bit weights (built on the device) stay cached otherwise, memory a colocated engine needs
            torch.cuda.empty_cache()
        if self.world_size == 1 and isinstance(self.optimizer, BF16_Optimizer):
            # ZeRO-1 in bf16 (DeepSpeed's BF16_Optimizer) all-reduces the fp32 gradients through a flat copy of
            # them and back, even with one rank, where the reduction changes nothing: skip it.
            self.engine.enable_backward_allreduce = False
        self.compiled = CompiledBlocks(self.engine.module, spec.model.compile_layers)
        if self.plan.needs_reference_model:
            reference = load_model(spec.model, spec.algorithm.seed, self.device).eval().requires_grad_(False)
            if self.stage == 3:  # partitioned (and offloaded) like the policy
                self.reference, *_ = deepspeed.initialize(model=reference, config=ds_config(self.plan, train=False))
                self.reference.eval()
            else:
                # ZeRO-1/2 partition only gradients and optimizer state, which a frozen model has none of: a stage-0
                # engine would hold the same whole weights and only add a broadcast of them from rank 0 at start
                # (every rank built them from the same seed already) and its wrapper around every forward. So a
                # plain module on the device, as the standalone backend's reference.
                self.reference = reference.to(self.device)

    def teardown(self) -> None:
        """Leave the process group through DeepSpeed, which also drops its own references to the group (a later
        `deepspeed.initialize` in this process would otherwise reuse the destroyed one)."""
        import deepspeed.comm

        if torch.distributed.is_initialized():
            deepspeed.comm.destroy_process_group()

    # --- the training step -------------------------------------------------------------------------

    def logprobs(self, part: TrainBatch, num_chunks: int, reference: bool) -> Tensor:
        """Log-probs of this rank's part in exactly `num_chunks` forwards (ZeRO-3 gathers are collective; ZeRO-1/2's
        forwards are not, and the padding forwards then only cost time)."""
        model = self.reference if reference else self.engine
        if model is None:
            raise RuntimeError("no reference model: algorithm.kl_coef is 0")
        return sharded_logprobs(model, part, num_chunks, self.plan.batch.micro_batch_size,
                                self.plan.spec.rollout.temperature, self.device)

    def forward_backward(self, shard: TrainBatch, norm: LossNorm, sizes: list[int] | None = None) -> dict[str, float]:
        """Forward + backward over `shard` in micro-batches of `sizes` sequences (default `micro_batch_size`
        each); every rank runs as many (see `rlspec.core.packing.plan_split`)."""
        self.maybe_fail()
        self.tracer.begin("train")  # through optimizer_step (`rlspec.perf.rank_trace`)
        engine = self.engine

        def backward(loss: Tensor) -> None:
            # The loss share is normalised by global counts (LossNorm); DeepSpeed averages gradients
            # over ranks, so undo that with x world size, and skip its 1/gradient_accumulation_steps.
            engine.backward(loss * self.world_size, scale_wrt_gas=False)

        with self.compiled.active():
            stats = accumulate(engine, shard, self.plan.batch.micro_batch_size, norm, self.loss_cfg,
                               self.plan.spec.rollout.temperature, backward, self.device, sizes,
                               boundary=engine.set_gradient_accumulation_boundary)
        if self.device.type == "cuda":
            stats["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
            stats["gpu_used_gb"] = gpu_used_gb(self.device)
        return stats

    def optimizer_step(self) -> float:
        """Clip (DeepSpeed's `gradient_clipping`), step, zero; the global grad norm before clipping."""
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self.tracer.end("train")
        return float(norm.item() if isinstance(norm, Tensor) else norm)

    # --- weights -------------------------------------------------------------------------------------

    def full_weights(self, keep: bool) -> Iterator[tuple[str, Tensor]]:
        """Full weights by the HF state-dict name (a tied weight under its first name only), gathered a group
        of `sync.bucket_mb` at a time on every rank (one ZeRO-3 gather per group, not per tensor). A rank that
        `keep`s (rank 0, or a colocated rank feeding the engine beside it) yields copies, after the group is
        released again, so the extra memory is one group; the other ranks only take part and yield nothing.
        ZeRO-1/2 weights are whole on every rank (no `ds_id`: the gather context does nothing) and are copied
        as they are."""
        import deepspeed

        module = self.engine.module
        for group in gather_groups(untied(module.state_dict(keep_vars=True).items(), tied_aliases(module)),
                                   self.plan.spec.sync.bucket_mb << 20, _full_nbytes):
            sharded = list({id(t): t for _, t in group if hasattr(t, "ds_id")}.values())  # tied: gathered once
            with deepspeed.zero.GatheredParameters(sharded, modifier_rank=None):
                copies = [(name, t.data.detach().clone()) for name, t in group] if keep else []
            yield from copies

    def save(self, path: str, save_optimizer: bool) -> None:
        """HF safetensors directory (rank 0) + the portable optimizer state by parameter name
        (`rlspec.runtime.checkpoints`), gathered from the ZeRO partitions: any backend at any rank count and
        any ZeRO stage resumes it."""
        self.run_sender(save_gathered, (self.engine.module, self.tokenizer, Path(path)))
        save_rng_state(Path(path), self.rank)
        if save_optimizer:
            tensors, step = self._portable_state()
            if self.rank == 0:
                write_optimizer_state(Path(path), tensors, self.plan.spec.algorithm.optimizer, step)

    def _trained(self) -> list[tuple[str, Tensor]]:
        return [(name, p) for name, p in self.engine.module.named_parameters() if p.requires_grad]

    def _master_flats(self) -> list[Tensor]:
        """This rank's fp32 master partitions, one flat tensor per parameter group: what the inner torch optimizer
        steps and keys its state by (ZeRO-3's and ZeRO-1/2's optimizers name them differently)."""
        if self.stage == 3:
            return self.optimizer.fp32_partitioned_groups_flat
        if hasattr(self.optimizer, "fp32_groups_flat_partition"):  # ZeRO-1 in 16-bit: BF16_Optimizer
            return self.optimizer.fp32_groups_flat_partition
        return self.optimizer.single_partition_of_fp32_groups

    def _portable_state(self) -> tuple[dict[str, Tensor], int]:
        """Full AdamW moments (and fp32 masters below fp32 weights) by parameter name on rank 0; every rank
        joins each gather, parameter by parameter."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        first = self.optimizer.optimizer.state.get(self._master_flats()[0], {})
        step = int(first["step"]) if "step" in first else 0
        keys = [key for key in ADAM_KEYS if key in first]
        if self.plan.spec.model.dtype != "float32":
            keys.append(MASTER_KEY)
        tensors = {}
        for name, param in self._trained():
            for key in keys:
                full = safe_get_full_fp32_param(param) if key == MASTER_KEY else safe_get_full_optimizer_state(param, key)
                if self.rank == 0:
                    tensors[f"{name}.{key}"] = full.cpu()
        return tensors, step

    def load(self, path: str) -> None:
        """Resume from a checkpoint of any backend: the safetensors weights, then the fp32 masters and AdamW
        moments of the portable optimizer state where saved (each rank keeps its partition). A checkpoint of an
        older rlspec with DeepSpeed's own `ZERO_DIR` (ZeRO-3 partitions) loads that instead."""
        load_rng_state(Path(path), self.rank)
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        zero = Path(path) / ZERO_DIR
        if zero.is_dir():  # weights (fp32 master partitions) and optimizer state, exactly as saved; ZeRO-3 only
            # (the driver's `DeepSpeedBackend.load` refuses another stage first)
            self.engine.load_checkpoint(str(zero), tag=ZERO_TAG, load_optimizer_states=True,
                                        load_lr_scheduler_states=False)
            return
        weights = read_safetensors_dir(Path(path))
        module = self.engine.module
        with torch.no_grad():
            for name, tensor in module.state_dict(keep_vars=True).items():
                if name not in weights:
                    continue
                # ZeRO-3: rank 0 writes the gathered parameter and DeepSpeed partitions its copy again. A ZeRO-1/2
                # parameter (no `ds_id`) is whole on every rank and the context does nothing: every rank writes.
                with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0):
                    if self.rank == 0 or not hasattr(tensor, "ds_id"):
                        tensor.data.copy_(weights[name].to(tensor.dtype))
        self.optimizer.refresh_fp32_params()  # each rank's fp32 master partition from the weights just written
        saved = read_optimizer_state(Path(path))
        if saved is None:
            return
        tensors, step = saved
        trained = self._trained()
        for name, param in trained:
            if f"{name}.{MASTER_KEY}" in tensors:
                safe_set_full_fp32_param(param, tensors[f"{name}.{MASTER_KEY}"])
        if not any(f"{name}.{ADAM_KEYS[0]}" in tensors for name, _ in trained):
            return
        inner = self.optimizer.optimizer
        # torch keeps the step count on the CPU, but on the tensor's device for the fused kernel
        fused = any(group.get("fused") for group in inner.param_groups)
        for flat in self._master_flats():  # torch creates AdamW state lazily: create it
            entry = inner.state[flat]
            for key in ADAM_KEYS:
                entry.setdefault(key, torch.zeros_like(flat))
            entry["step"] = torch.tensor(float(step), device=flat.device if fused else "cpu")
        if self.stage != 3:
            # ZeRO-1/2 point each parameter's moment fragments into that state only after the first step (until
            # then `safe_set_full_optimizer_state` has nowhere to write): point them now, at the state just made,
            # which the first step then updates in place (a no-op once linked).
            self.optimizer._lazy_init_hp_params_optimizer_state()
        for name, param in trained:
            for key in ADAM_KEYS:
                safe_set_full_optimizer_state(param, tensors[f"{name}.{key}"], key)


def _full_nbytes(tensor: Tensor) -> int:
    """Bytes of a tensor once gathered (a ZeRO-3 partitioned parameter reports its full size in `ds_numel`)."""
    return getattr(tensor, "ds_numel", tensor.numel()) * tensor.element_size()
