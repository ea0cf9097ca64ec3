"""The spec: one typed dataclass per section. Defaults live here and in `spec.sources` (the task, judge, environment
and agent sections of `rollout`), nowhere else.

Each section validates itself in `__post_init__` (run by `OmegaConf.to_object`) and raises `SpecError`
naming the exact key. Checks that span sections live in `spec.compile`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

from .errors import one_of, require
from .section import Section, finite, non_negative, positive
from .evaluation import EvalSpec
from .sources import AgentSpec, EnvSpec, TaskSpec

OPTIMIZERS = ("adamw", "sgd")
KL_ESTIMATORS = ("k1", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ADV_NORMS = ("group_std", "none")
MODEL_KINDS = ("causal_lm", "vla")
DTYPES = ("float32", "bfloat16", "float16")
ENGINES = ("hf", "vllm")
ROLLOUT_MODES = ("sync", "async")
DISPATCHES = ("auto", "queue", "split")
FREE_DURING_TRAIN = ("none", "kv_cache", "kv_cache_and_weights")
SYNC_METHODS = ("auto", "shared", "nccl", "ray", "cuda_ipc", "checkpoint", "lora")
DEVICES = ("cpu", "cuda")
PLACEMENTS = ("colocated", "separate")
STALL_ACTIONS = ("fail", "warn")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
WANDB_MODES = ("online", "offline")
BEST_MODES = ("max", "min")


@dataclass
class AlgorithmSpec(Section):
    """GRPO hyper-parameters (the loss itself is `rlspec.core.grpo`)."""

    group_size: int = 8
    """Completions sampled per prompt; advantages are normalised within each group."""
    lr: float = 1e-6
    """Learning rate of the policy optimizer (constant schedule)."""
    optimizer: str = "adamw"
    """Policy optimizer: adamw | sgd (sgd makes gradient-scale bugs visible in conformance)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 (SGD)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (grad_norm is still logged)."""
    clip_eps_low: float = 0.2
    """PPO ratio clip below: ratio >= 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """PPO ratio clip above: ratio <= 1 + clip_eps_high (DAPO's clip-higher uses 0.28)."""
    dual_clip_c: Optional[float] = None
    """Dual-clip bound c > 1 for negative advantages (verl uses 3.0); null disables it."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling: weight each token's policy loss by min(pi_old / pi_engine, tis_cap) (stale or mismatched engine); null disables."""
    skip_zero_advantage_updates: bool = False
    """Skip a mini-batch update whose every advantage is 0 (all groups solved or all failed) while kl_coef is 0:
    its gradient is exactly zero, but AdamW would still move the weights on momentum and weight decay. Counted
    in `train/skipped_updates`. Off by default: every step steps the optimizer, as in verl and TRL."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy; 0 builds no reference model."""
    kl_estimator: str = "k3"
    """KL estimator: k1 (log-ratio) | k3 (Schulman's unbiased low-variance estimator)."""
    loss_agg: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum-norm (Dr. GRPO)."""
    adv_norm: str = "group_std"
    """Advantage normalisation: group_std ((r - mean) / (std + adv_eps)) | none (r - mean, Dr. GRPO)."""
    adv_eps: float = 1e-6
    """Epsilon added to the group std (verl's value; TRL uses 1e-4)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward on one trainer rank; gradients accumulate over micro-batches."""
    micro_batch_tokens: int = 0
    """Split each update's forward/backward by tokens instead: micro-batches of at most this many real tokens
    (a longer sequence is a micro-batch of its own), the sequences balanced over the trainer ranks by real
    tokens and each rank's micro-batches evened out (as few as the budget allows, near equal in tokens;
    `rlspec.core.packing` states the rule). 0 = off: `micro_batch_size` sequences per micro-batch.
    The no-gradient log-prob passes keep `micro_batch_size`."""
    updates_per_batch: int = 1
    """Optimizer updates per rollout batch: the batch splits into exactly this many mini-batches, as equal as its rows
    allow (an agent's batch size varies)."""
    steps: int = 100
    """Rollout/update steps to run."""
    seed: int = 0
    """Seed for model init, sampling and the data order (the record order unless rollout.task.shuffle_seed is set)."""

    def __post_init__(self) -> None:
        p = "algorithm"
        require(self.group_size >= 2, f"{p}.group_size", f"must be >= 2, got {self.group_size}",
                "GRPO compares completions within a group; use 2 or more")
        positive(self.lr, f"{p}.lr")
        finite(self.lr, f"{p}.lr")
        one_of(self.optimizer, OPTIMIZERS, f"{p}.optimizer")
        non_negative(self.weight_decay, f"{p}.weight_decay")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            require(0 <= value < 1, f"{p}.{name}", f"must be in [0, 1), got {value}", "the usual values are 0.9 and 0.999")
        positive(self.adam_eps, f"{p}.adam_eps")
        non_negative(self.max_grad_norm, f"{p}.max_grad_norm")
        for name in ("clip_eps_low", "clip_eps_high"):
            value = getattr(self, name)
            require(0 < value < 10, f"{p}.{name}", f"must be in (0, 10), got {value}",
                    "typical values are 0.2 (low) and 0.2-0.28 (high)")
        require(self.clip_eps_low < 1, f"{p}.clip_eps_low", f"must be < 1, got {self.clip_eps_low}",
                "1 - clip_eps_low is the lower ratio bound and must stay positive")
        if self.dual_clip_c is not None:
            require(self.dual_clip_c > 1, f"{p}.dual_clip_c", f"must be > 1, got {self.dual_clip_c}",
                    "use 3.0 (verl's value) or null to disable dual-clip")
        if self.tis_cap is not None:
            require(math.isfinite(self.tis_cap) and self.tis_cap >= 1, f"{p}.tis_cap", f"must be a finite number >= 1, got {self.tis_cap}",
                    "a cap below 1 would down-weight on-policy tokens too; use 2.0 (a common value) or null to disable")
        non_negative(self.kl_coef, f"{p}.kl_coef")
        one_of(self.kl_estimator, KL_ESTIMATORS, f"{p}.kl_estimator")
        one_of(self.loss_agg, LOSS_AGGS, f"{p}.loss_agg")
        one_of(self.adv_norm, ADV_NORMS, f"{p}.adv_norm")
        positive(self.adv_eps, f"{p}.adv_eps")
        positive(self.micro_batch_size, f"{p}.micro_batch_size")
        non_negative(self.micro_batch_tokens, f"{p}.micro_batch_tokens")
        positive(self.updates_per_batch, f"{p}.updates_per_batch")
        positive(self.steps, f"{p}.steps")
        non_negative(self.seed, f"{p}.seed")


@dataclass
class LoraSpec(Section):
    """LoRA adapters on the policy (r = 0 trains the full model)."""

    r: int = 0
    """Adapter rank; 0 disables LoRA."""
    alpha: int = 16
    """Adapter scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input, in the update's forward only (the no-gradient log-prob passes run in eval mode)."""
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that receive adapters."""

    def __post_init__(self) -> None:
        p = "model.lora"
        non_negative(self.r, f"{p}.r")
        positive(self.alpha, f"{p}.alpha")
        require(0 <= self.dropout < 1, f"{p}.dropout", f"must be in [0, 1), got {self.dropout}", "use 0.0 to 0.1")
        if self.r:
            require(len(self.target_modules) > 0, f"{p}.target_modules", "is empty while model.lora.r > 0",
                    "name at least one module, e.g. [q_proj, v_proj]")


@dataclass
class ModelSpec(Section):
    """The policy model: a tiny preset built from a config, or a local Hugging Face directory."""

    preset: str = "tiny_qwen2"
    """Built-in model preset (random init from a config + local tokenizer); used when `path` is null."""
    path: Optional[str] = None
    """Local directory with a Hugging Face model and tokenizer; overrides `preset` when set."""
    kind: str = "causal_lm"
    """causal_lm | vla (vision-language-action)."""
    dtype: str = "float32"
    """Parameter/compute dtype of trainer and engine: float32 | bfloat16 | float16."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    attn_implementation: str = "eager"
    """Attention kernel (eager | sdpa | flash_attention_2); eager makes trainer and engine agree bit-for-bit on CPU."""
    compile_layers: bool = False
    """`torch.compile` each decoder layer for the train forward/backward (regional compilation, dynamic shapes so
    packed lengths do not recompile; `rlspec.core.policy.CompiledBlocks`); causal_lm on every backend (deepspeed's
    ZeRO-3 then gathers each layer's parameters whole, as leaf modules; ZeRO-1/2 have no module hooks to avoid). The
    first step pays the compile (tens of seconds); off by default."""
    lora: LoraSpec = field(default_factory=LoraSpec)
    """LoRA settings."""
    eos_hazard: float = 0.0
    """Random-init presets: set the weights so that at every step, sampling at temperature 1, the end token has this
    probability (completion lengths geometric, median ln 2 / eos_hazard; `rlspec.models.factory.set_eos_hazard`);
    0 leaves the random init as it is (the end token is then almost never sampled)."""

    def __post_init__(self) -> None:
        p = "model"
        require(0 <= self.eos_hazard < 1, f"{p}.eos_hazard", f"must be in [0, 1), got {self.eos_hazard}",
                "e.g. 0.0069 for a median completion of 100 tokens")
        require(self.eos_hazard == 0 or (self.path is None and self.kind == "causal_lm"), f"{p}.eos_hazard",
                "applies to random-init causal_lm presets only", "drop model.eos_hazard, or unset model.path")
        one_of(self.kind, MODEL_KINDS, f"{p}.kind")
        require(not (self.compile_layers and self.kind == "vla"), f"{p}.compile_layers",
                "regional compilation is wired and tested for causal_lm policies only", "set model.compile_layers=false")
        one_of(self.dtype, DTYPES, f"{p}.dtype")
        one_of(self.attn_implementation, ("eager", "sdpa", "flash_attention_2"), f"{p}.attn_implementation")
        require(bool(self.preset) or bool(self.path), f"{p}.preset",
                "neither model.preset nor model.path is set", "name a preset (e.g. tiny_qwen2) or a local directory")


@dataclass
class RolloutSpec(Section):
    """How completions are sampled."""

    engine: str = "hf"
    """Rollout engine: hf (transformers, batched sampling) | vllm."""
    task: TaskSpec = field(default_factory=TaskSpec)
    """The task: prompts and reward (text policies)."""
    env: EnvSpec = field(default_factory=EnvSpec)
    """The environment (vision-language-action policies); a group is group_size episodes from one seed."""
    prompts_per_step: int = 8
    """Prompts (with an env: episode seeds) per rollout batch: prompts_per_step * algorithm.group_size sequences (episodes)."""
    max_new_tokens: int = 32
    """Completion length budget (also Dr. GRPO's constant normaliser)."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are refused with an error naming the task."""
    temperature: float = 1.0
    """Sampling temperature; trainer logprobs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    cuda_graph: bool = True
    """hf engine on CUDA: static KV cache + CUDA-graph decode (Llama-style models without LoRA); false = plain loop."""
    continuous_batching: bool = True
    """cuda_graph sampler: decode in a pool of `decode_slots` slots, refilling a slot with the next sample as soon as
    its sample ends; false = the static batch (all rows at once, until the longest has ended)."""
    decode_slots: int = 256
    """continuous_batching: sequences decoded at once (rounded up to a power of two; K/V memory grows with it:
    slots x (prompt + max_new_tokens) tokens). A decode step's cost grows far less than its rows (0.5B shape, one
    H100: 1.40 ms at 64 rows with a 384-token cache, 2.99 ms at 256 rows with 1,152), so starting every sample
    at once is faster: the long-tailed 32 x 8 bench generated in 1.74 s with 256 slots, 2.06 s with 64."""
    free_during_train: str = "kv_cache"
    """hf engine: what it gives back after each rollout, for the train phase. none: its K/V cache and graphs go to its
    process's allocator cache (a trainer in the same process reuses them; an engine process of its own keeps holding
    them); kv_cache: an engine in a process of its own also hands that memory back to the device; kv_cache_and_weights:
    and its own copy of the weights, restored by the next push (needs sync.every_n_steps=1 and a sync method that
    pushes full weights). docs/models.md has the measured cost."""
    gpu_memory_fraction: float = 0.5
    """vllm: fraction of GPU memory the engine may take."""
    tensor_parallel_size: int = 1
    """vllm: tensor-parallel degree of one engine."""
    mode: str = "sync"
    """sync (generate, then train, then sync) | async (a rollout loop fills a bounded pool while the trainer consumes)."""
    max_staleness: int = 1
    """async: policy versions (trainer steps) a batch may lag the policy that trains on it; 0 reproduces sync."""
    server_url: Optional[str] = None
    """hardware.rollout=separate: join the `rlspec serve` at this URL instead of starting one (its bridge token in RLSPEC_SERVE_TOKEN)."""
    server_urls: List[str] = field(default_factory=list)
    """hardware.rollout=separate, standalone: join these `rlspec serve`s (one per hardware.num_rollout_engines, one bridge
    token for all) instead of starting them; each step's groups are split across them."""
    request_timeout_s: float = 600.0
    """A rollout-server request (one generation batch) that takes longer fails the run; if the server then answers no
    health check either (stopped or hung), one the run started is restarted (as when lost) and a joined one is named."""
    server_start_timeout_s: float = 300.0
    """A rollout server (started or joined) that is not healthy within this many seconds fails the run."""
    server_reconnect_s: float = 60.0
    """A rollout server lost mid-run (connections refused or dropped): wait this long for it (a joined one) or a restarted one
    (one the run started) to be healthy, push the current weights and re-run the interrupted requests; 0 fails at once."""
    agent: AgentSpec = field(default_factory=AgentSpec)
    """Multi-turn black-box agent (unset: plain single-turn sampling)."""
    dispatch: str = "auto"
    """Several engines: how a step's prompts reach them. queue: in chunks of whole groups, each engine taking the next
    chunk when it finishes one (a slow engine takes fewer, but each chunk runs to its own longest sample) | split:
    one fixed run per engine (all its samples at once) | auto: the plan picks (`dispatch` in `rlspec plan`): queue
    where an engine's share of a step does not fit its decode_slots, else split. The samples are the same either way."""
    dispatch_chunk_prompts: int = 0
    """dispatch=queue: prompts (groups) per chunk; 0: the plan picks decode_slots // algorithm.group_size (a chunk
    fills an engine's slots), at most an engine's share of prompts_per_step (every engine gets work)."""

    def __post_init__(self) -> None:
        p = "rollout"
        one_of(self.dispatch, DISPATCHES, f"{p}.dispatch")
        non_negative(self.dispatch_chunk_prompts, f"{p}.dispatch_chunk_prompts")
        one_of(self.engine, ENGINES, f"{p}.engine")
        positive(self.prompts_per_step, f"{p}.prompts_per_step")
        positive(self.max_new_tokens, f"{p}.max_new_tokens")
        positive(self.decode_slots, f"{p}.decode_slots")
        positive(self.max_prompt_tokens, f"{p}.max_prompt_tokens")
        positive(self.temperature, f"{p}.temperature")
        require(0 < self.top_p <= 1, f"{p}.top_p", f"must be in (0, 1], got {self.top_p}", "use 1.0 to sample from the full distribution")
        require(0 < self.gpu_memory_fraction <= 1, f"{p}.gpu_memory_fraction",
                f"must be in (0, 1], got {self.gpu_memory_fraction}", "e.g. 0.5")
        positive(self.tensor_parallel_size, f"{p}.tensor_parallel_size")
        one_of(self.mode, ROLLOUT_MODES, f"{p}.mode")
        one_of(self.free_during_train, FREE_DURING_TRAIN, f"{p}.free_during_train")
        non_negative(self.max_staleness, f"{p}.max_staleness")
        if self.server_url is not None:
            require(self.server_url.startswith(("http://", "https://")), f"{p}.server_url",
                    f"{self.server_url!r} is not an http(s) URL", "e.g. http://127.0.0.1:8000, or null to start a server")
        for i, url in enumerate(self.server_urls):
            require(isinstance(url, str) and url.startswith(("http://", "https://")), f"{p}.server_urls[{i}]",
                    f"{url!r} is not an http(s) URL", "e.g. [http://127.0.0.1:8000, http://127.0.0.1:8001], or [] to start them")
        require(len(set(self.server_urls)) == len(self.server_urls), f"{p}.server_urls", "a server is listed twice",
                "list each server once")
        positive(self.request_timeout_s, f"{p}.request_timeout_s")
        positive(self.server_start_timeout_s, f"{p}.server_start_timeout_s")
        non_negative(self.server_reconnect_s, f"{p}.server_reconnect_s")


@dataclass
class SyncSpec(Section):
    """How trainer weights reach the rollout engine."""

    method: str = "auto"
    """auto | shared | nccl | ray | cuda_ipc | checkpoint | lora; auto picks from backend and placement."""
    bucket_mb: int = 256
    """Weights are flattened into buckets of at most this many MB per transfer."""
    every_n_steps: int = 1
    """Sync after every N-th optimizer step (N > 1 makes rollouts off-policy)."""
    timeout_s: float = 120.0
    """A transfer or rendezvous that takes longer raises instead of hanging."""
    verify: bool = True
    """After each sync, compare a checksum of the engine's weights with the trainer's."""

    def __post_init__(self) -> None:
        p = "sync"
        one_of(self.method, SYNC_METHODS, f"{p}.method")
        positive(self.bucket_mb, f"{p}.bucket_mb")
        positive(self.every_n_steps, f"{p}.every_n_steps")
        positive(self.timeout_s, f"{p}.timeout_s")


ZERO_STAGES = (1, 2, 3)


@dataclass
class DeepSpeedSpec(Section):
    """The ZeRO stage and the communication knobs of the `deepspeed` backend (`backends/deepspeed/README.md` says
    what each trades and when to pick stage 1, 2 or 3).

    Sizes are element counts (parameters or gradient values), as DeepSpeed counts them, not bytes. The `stage3_*`
    knobs (`prefetch_bucket_numel`, `param_persistence_numel`, `max_live_numel`, `module_granularity_numel`,
    `memory_efficient_linear`) act only with `zero_stage: 3`. Other backends ignore this section.
    """

    zero_stage: Optional[int] = None
    """ZeRO stage: 3 partitions weights, gradients and optimizer state over the trainer ranks (each weight gathered
    by per-module hooks when it is used); 2 partitions gradients and optimizer state only, so every rank holds the
    full 16-bit weights and no hooks run around the modules or gather weights in the forward and backward; 1
    partitions only the optimizer state (fp32 masters and moments): every rank also holds full gradients, all-reduced
    once a step, with no per-parameter hook in the backward in fp32 and one that adds each gradient into its fp32
    accumulator in bf16. 1 and 2 are for a model whose weights (and, for 1, gradients) fit on every rank. null
    (default): the plan picks (`sharding` in `rlspec plan`): 1 where the model's 16-bit weights and gradients fit in
    `zero1_max_gb`, else 3 (and 3 with `hardware.offload_params`, which needs it, or a model whose size the plan
    cannot tell). On 2 H200s at 32 prompts x 8 a GPU of the 0.5B bench spec, stage 1 took 0.49 s a train phase and
    0.023 s a push against stage 3's 0.74 s and 0.068 s (`docs/multigpu.md`)."""
    zero1_max_gb: float = 16.0
    """With `zero_stage` null: the most GB that every rank may hold of the model's whole 16-bit weights plus
    gradients (4 bytes a parameter) for the plan to pick ZeRO-1; larger models take ZeRO-3. 16 GB: up to 4B
    parameters."""
    overlap_comm: bool = False
    """Overlap gradient reduce-scatter with the backward (DeepSpeed's `overlap_comm`); costs extra bucket memory."""
    contiguous_gradients: bool = True
    """Copy reduced gradients into one contiguous buffer as they are produced (`contiguous_gradients`)."""
    reduce_bucket_numel: int = 50_000_000
    """Gradient values reduced per collective (`reduce_bucket_size`)."""
    prefetch_bucket_numel: int = 50_000_000
    """Parameter values gathered ahead of use (`stage3_prefetch_bucket_size`); 0 turns prefetching off."""
    param_persistence_numel: Optional[int] = None
    """Parameters with fewer values stay whole on every rank, never partitioned (`stage3_param_persistence_threshold`).
    null (default): every parameter with one trainer rank and `hardware.offload_params` off, else 1e5. One rank
    holds every parameter whole anyway, and on CUDA each fetch of a partitioned one synchronises the host with the
    device (DeepSpeed's single-rank gather handle), which left the GPU idle while the next layer's hooks ran
    (`backends/deepspeed/README.md`)."""
    max_live_numel: int = 1_000_000_000
    """Gathered parameter values a rank keeps at once before releasing some (`stage3_max_live_parameters`)."""
    module_granularity_numel: int = 0
    """Gather a module's parameters whole, with no hooks on its submodules, where its parameter values per
    submodule (parameters / (1 + descendants)) are at most this (`stage3_module_granularity_threshold`; the
    first such module from the root down): fewer Python hooks per step for larger gathers. 0 = off."""
    memory_efficient_linear: Optional[bool] = None
    """ZeRO-3's own autograd function for every linear layer, which keeps no gathered weight for the backward
    (`memory_efficient_linear`); false uses torch's. null (default): true, but false with `model.compile_layers`,
    where each layer is gathered whole for its backward anyway and a compiled layer's forward recompiled for
    layer after layer with ZeRO-3's function inside (`backends/deepspeed/README.md`)."""

    def __post_init__(self) -> None:
        p = "hardware.deepspeed"
        require(self.zero_stage is None or self.zero_stage in ZERO_STAGES, f"{p}.zero_stage",
                f"{self.zero_stage!r} is not a ZeRO stage this backend runs",
                f"set {p}.zero_stage to 3 (weights partitioned), 2 (full weights on every rank) or 1 (full weights "
                "and gradients on every rank), or null to let the plan pick")
        positive(self.zero1_max_gb, f"{p}.zero1_max_gb")
        positive(self.reduce_bucket_numel, f"{p}.reduce_bucket_numel")
        non_negative(self.prefetch_bucket_numel, f"{p}.prefetch_bucket_numel")
        if self.param_persistence_numel is not None:
            non_negative(self.param_persistence_numel, f"{p}.param_persistence_numel")
        positive(self.max_live_numel, f"{p}.max_live_numel")
        non_negative(self.module_granularity_numel, f"{p}.module_granularity_numel")


@dataclass
class FSDPSpec(Section):
    """FSDP2 knobs of the `fsdp` backend (`backends/fsdp/README.md`). Other backends ignore this section."""

    reshard_after_forward: Optional[bool] = None
    """Free each block's gathered parameters after its forward and gather them again for its backward (FSDP2's
    `reshard_after_forward`): less memory for one more all-gather per block and micro-batch. False keeps each
    gathered block until the step's last backward (one gather per block and step, the whole model gathered at
    once). null (default): the plan picks (`sharding` in `rlspec plan`): false where the model's whole 16-bit
    weights fit in `gathered_max_gb` (and always with one rank, where the gather is a copy of what the rank holds),
    else true. On 2 H200s at 64 prompts x 8 a GPU of the 0.5B bench spec a rank's train phase took 0.90 s kept
    gathered against 0.98 s resharded, and one rank alone 0.90 s (`docs/multigpu.md`)."""
    gathered_max_gb: float = 8.0
    """With `reshard_after_forward` null: the most GB of the model's whole 16-bit weights (2 bytes a parameter)
    that every rank may keep gathered through an update for the plan to pick false. 8 GB: up to 4B parameters."""
    gather_during_rollout: bool = True
    """Where parameters stay gathered through an update (`reshard_after_forward` false), gather them for the next
    update while the engines sample its batch (asynchronous: while the trainer waits for it): the train phase
    then starts without the gather, and the 16-bit weights occupy the trainer's GPU memory during sampling too.
    False gathers them in the update's first forward."""

    def __post_init__(self) -> None:
        positive(self.gathered_max_gb, "hardware.fsdp.gathered_max_gb")


@dataclass
class HardwareSpec(Section):
    """Where things run."""

    device: str = "cpu"
    """cpu | cuda."""
    num_trainer_ranks: int = 1
    """Data-parallel trainer ranks (processes)."""
    num_rollout_engines: int = 1
    """Rollout engine replicas: Ray engine actors (fsdp, deepspeed) or, separate, rlspec serve processes (standalone)."""
    rollout: str = "colocated"
    """colocated (engines share the trainer's devices) | separate (engines on their own devices)."""
    offload_params: bool = False
    """Keep sharded parameters in host memory between uses (FSDP CPU offload; deepspeed: ZeRO-3 only)."""
    offload_optimizer: bool = False
    """Keep optimizer state in host memory."""
    ray_address: Optional[str] = None
    """Ray cluster to join; null starts a local one."""
    placement_strategy: str = "PACK"
    """Ray placement of the ranks' bundles: PACK (fewest nodes) | SPREAD (across nodes) | STRICT_PACK | STRICT_SPREAD."""
    num_threads: int = 0
    """torch intra-op threads per process on CPU; 0 leaves torch's default."""
    stall_timeout_s: float = 900.0
    """No step done for this long: dump every process's stacks to OUT/stall/ (0: off); under the 30-min collective timeout."""
    stall_first_step_s: float = 900.0
    """The window of a process's first step, if longer than `stall_timeout_s`: that step also compiles the layers,
    captures the engine's graphs and warms every rank up, so a short `stall_timeout_s` (to catch a stuck collective
    within seconds) must not fire on it."""
    stall_action: str = "fail"
    """What a stall does after the dump: fail (exit 1) | warn (keep waiting, dump again after another timeout)."""
    preempt_grace_s: float = 30.0
    """After SIGTERM/SIGINT, the time the run has to finish (or abandon) its step and checkpoint it; past it the
    run exits 143 without that checkpoint (the previous one stays the latest). Schedulers kill after their own
    grace (Slurm's KillWait, 30 s; Kubernetes' terminationGracePeriodSeconds): keep this below theirs."""
    deepspeed: DeepSpeedSpec = field(default_factory=DeepSpeedSpec)
    """ZeRO stage, bucket, prefetch and overlap settings (the `deepspeed` backend only)."""
    fsdp: FSDPSpec = field(default_factory=FSDPSpec)
    """FSDP2 settings (the `fsdp` backend only)."""

    def __post_init__(self) -> None:
        p = "hardware"
        positive(self.preempt_grace_s, f"{p}.preempt_grace_s")
        finite(self.preempt_grace_s, f"{p}.preempt_grace_s")
        one_of(self.device, DEVICES, f"{p}.device")
        positive(self.num_trainer_ranks, f"{p}.num_trainer_ranks")
        positive(self.num_rollout_engines, f"{p}.num_rollout_engines")
        one_of(self.rollout, PLACEMENTS, f"{p}.rollout")
        one_of(self.placement_strategy, PLACEMENT_STRATEGIES, f"{p}.placement_strategy")
        non_negative(self.num_threads, f"{p}.num_threads")
        non_negative(self.stall_timeout_s, f"{p}.stall_timeout_s")
        finite(self.stall_timeout_s, f"{p}.stall_timeout_s")
        non_negative(self.stall_first_step_s, f"{p}.stall_first_step_s")
        finite(self.stall_first_step_s, f"{p}.stall_first_step_s")
        one_of(self.stall_action, STALL_ACTIONS, f"{p}.stall_action")


@dataclass
class CheckpointSpec(Section):
    """When and what to save under OUT/checkpoints/."""

    every_n_steps: int = 0
    """Save every N steps (0: only at the end); the final step is always saved."""
    keep_last: int = 2
    """Keep this many most recent checkpoints (0 keeps all)."""
    save_optimizer: bool = True
    """Also save optimizer state so a run can resume exactly."""
    keep_best: Optional[str] = None
    """An eval metric (e.g. eval/mean@1): every eval during training also saves a checkpoint, and the keep_best_n
    best by it are kept beside the keep_last most recent (OUT/checkpoints/best.json lists the scores); null: off."""
    keep_best_n: int = 1
    """How many best checkpoints keep_best keeps."""
    keep_best_mode: str = "max"
    """max: a higher keep_best metric is better | min: a lower one."""

    def __post_init__(self) -> None:
        non_negative(self.every_n_steps, "checkpoint.every_n_steps")
        non_negative(self.keep_last, "checkpoint.keep_last")
        positive(self.keep_best_n, "checkpoint.keep_best_n")
        one_of(self.keep_best_mode, BEST_MODES, "checkpoint.keep_best_mode")
        if self.keep_best is not None:
            require(self.keep_best.startswith("eval/"), "checkpoint.keep_best",
                    f"{self.keep_best!r} is not an eval metric", "name one, e.g. eval/mean@1 (docs/evaluation.md)")


@dataclass
class WandbSpec(Section):
    """Weights & Biases (`pip install 'rlspec[loggers]'`): every step's numeric metrics, the plan as the run's config."""

    enabled: bool = False
    """Log to Weights & Biases (a run that cannot start its W&B run stops before training, exit 2)."""
    project: str = "rlspec"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (user or team); null: the logged-in user's default entity."""
    run_name: Optional[str] = None
    """Name of the W&B run; null: the output directory's name."""
    mode: str = "online"
    """online (needs `wandb login` or WANDB_API_KEY) | offline (writes under OUT/wandb/; `wandb sync` uploads it later)."""
    tags: List[str] = field(default_factory=list)
    """Tags of the W&B run."""

    def __post_init__(self) -> None:
        one_of(self.mode, WANDB_MODES, "logging.wandb.mode")
        require(bool(self.project), "logging.wandb.project", "must not be empty", "name a W&B project")


@dataclass
class MLflowSpec(Section):
    """MLflow (`pip install 'rlspec[loggers]'`, the tracking client `mlflow-skinny`): every step's numeric metrics, the
    plan's keys as the run's parameters and the plan as its `plan.json` artifact."""

    enabled: bool = False
    """Log to MLflow (a run that cannot start its MLflow run stops before training, exit 2)."""
    tracking_uri: Optional[str] = None
    """Tracking server or store: http(s)://host:port, databricks, file:///abs/path/mlruns (MLflow 3 wants
    MLFLOW_ALLOW_FILE_STORE=true for a file store); null: MLflow's default (MLFLOW_TRACKING_URI, else ./mlruns)."""
    experiment: str = "rlspec"
    """Experiment name; created when it does not exist."""
    run_name: Optional[str] = None
    """Name of the MLflow run; null: the output directory's name."""

    def __post_init__(self) -> None:
        require(bool(self.experiment), "logging.mlflow.experiment", "must not be empty", "name an MLflow experiment")


@dataclass
class LoggingSpec(Section):
    """Where each step's metrics go besides OUT/metrics.jsonl, which every run writes. A logger that fails during
    the run is stopped with a warning; training goes on and metrics.jsonl keeps every step."""

    tensorboard: bool = True
    """Write TensorBoard events under OUT/tensorboard/."""
    wandb: WandbSpec = field(default_factory=WandbSpec)
    """Weights & Biases."""
    mlflow: MLflowSpec = field(default_factory=MLflowSpec)
    """MLflow."""


@dataclass
class Spec(Section):
    """A whole experiment."""

    algorithm: AlgorithmSpec = field(default_factory=AlgorithmSpec)
    """GRPO hyper-parameters."""
    model: ModelSpec = field(default_factory=ModelSpec)
    """The policy."""
    rollout: RolloutSpec = field(default_factory=RolloutSpec)
    """Sampling and task."""
    sync: SyncSpec = field(default_factory=SyncSpec)
    """Weight sync."""
    hardware: HardwareSpec = field(default_factory=HardwareSpec)
    """Placement."""
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    """Checkpointing."""
    logging: LoggingSpec = field(default_factory=LoggingSpec)
    """Loggers beside metrics.jsonl."""
    eval: EvalSpec = field(default_factory=EvalSpec)
    """Held-out evaluation during and after training."""
    backend: str = "standalone"
    """Trainer backend (deepspeed | fsdp | standalone); `--backend` on the CLI overrides it."""
