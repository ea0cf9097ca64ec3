"""The spec: one typed dataclass per section. Defaults live here and nowhere else.

Each section validates itself in `__post_init__` (run by `OmegaConf.to_object`) and raises `SpecError`
naming the exact key. Checks that span sections live in `spec.compile`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .errors import one_of, require

OPTIMIZERS = ("adamw", "sgd")
KL_ESTIMATORS = ("k1", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ADV_NORMS = ("group_std", "none")
MODEL_KINDS = ("causal_lm", "vla")
DTYPES = ("float32", "bfloat16", "float16")
ENGINES = ("hf", "vllm")
SYNC_METHODS = ("auto", "shared", "nccl", "ray", "cuda_ipc", "checkpoint", "lora")
DEVICES = ("cpu", "cuda")
PLACEMENTS = ("colocated", "separate")


class _Section:
    """Base of every spec section: mutable while OmegaConf builds it, read-only once `freeze`d by the compiler."""

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"the spec is frozen once compiled; cannot set {type(self).__name__}.{name}")
        object.__setattr__(self, name, value)

    def freeze(self) -> None:
        """Make this section and its nested sections read-only."""
        for value in vars(self).values():
            if isinstance(value, _Section):
                value.freeze()
        object.__setattr__(self, "_frozen", True)


def _positive(value: float, where: str) -> None:
    require(value > 0, where, f"must be > 0, got {value}", f"set {where} to a positive value")


def _non_negative(value: float, where: str) -> None:
    require(value >= 0, where, f"must be >= 0, got {value}", f"set {where} to 0 or more")


def _finite(value: float, where: str) -> None:
    require(math.isfinite(value), where, f"must be a finite number, got {value}", f"set {where} to a finite number")


@dataclass
class AlgorithmSpec(_Section):
    """GRPO hyper-parameters (the loss itself is `rlspec.grpo`)."""

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
    updates_per_batch: int = 1
    """Optimizer updates per rollout batch (the batch is split into this many mini-batches)."""
    steps: int = 100
    """Rollout/update steps to run."""
    seed: int = 0
    """Seed for model init, data order and sampling."""

    def __post_init__(self) -> None:
        p = "algorithm"
        require(self.group_size >= 2, f"{p}.group_size", f"must be >= 2, got {self.group_size}",
                "GRPO compares completions within a group; use 2 or more")
        _positive(self.lr, f"{p}.lr")
        _finite(self.lr, f"{p}.lr")
        one_of(self.optimizer, OPTIMIZERS, f"{p}.optimizer")
        _non_negative(self.weight_decay, f"{p}.weight_decay")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            require(0 <= value < 1, f"{p}.{name}", f"must be in [0, 1), got {value}", "the usual values are 0.9 and 0.999")
        _positive(self.adam_eps, f"{p}.adam_eps")
        _non_negative(self.max_grad_norm, f"{p}.max_grad_norm")
        for name in ("clip_eps_low", "clip_eps_high"):
            value = getattr(self, name)
            require(0 < value < 10, f"{p}.{name}", f"must be in (0, 10), got {value}",
                    "typical values are 0.2 (low) and 0.2-0.28 (high)")
        require(self.clip_eps_low < 1, f"{p}.clip_eps_low", f"must be < 1, got {self.clip_eps_low}",
                "1 - clip_eps_low is the lower ratio bound and must stay positive")
        if self.dual_clip_c is not None:
            require(self.dual_clip_c > 1, f"{p}.dual_clip_c", f"must be > 1, got {self.dual_clip_c}",
                    "use 3.0 (verl's value) or null to disable dual-clip")
        _non_negative(self.kl_coef, f"{p}.kl_coef")
        one_of(self.kl_estimator, KL_ESTIMATORS, f"{p}.kl_estimator")
        one_of(self.loss_agg, LOSS_AGGS, f"{p}.loss_agg")
        one_of(self.adv_norm, ADV_NORMS, f"{p}.adv_norm")
        _positive(self.adv_eps, f"{p}.adv_eps")
        _positive(self.micro_batch_size, f"{p}.micro_batch_size")
        _positive(self.updates_per_batch, f"{p}.updates_per_batch")
        _positive(self.steps, f"{p}.steps")
        _non_negative(self.seed, f"{p}.seed")


@dataclass
class LoraSpec(_Section):
    """LoRA adapters on the policy (r = 0 trains the full model)."""

    r: int = 0
    """Adapter rank; 0 disables LoRA."""
    alpha: int = 16
    """Adapter scaling numerator (scale = alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that receive adapters."""

    def __post_init__(self) -> None:
        p = "model.lora"
        _non_negative(self.r, f"{p}.r")
        _positive(self.alpha, f"{p}.alpha")
        require(0 <= self.dropout < 1, f"{p}.dropout", f"must be in [0, 1), got {self.dropout}", "use 0.0 to 0.1")
        if self.r:
            require(len(self.target_modules) > 0, f"{p}.target_modules", "is empty while model.lora.r > 0",
                    "name at least one module, e.g. [q_proj, v_proj]")


@dataclass
class ModelSpec(_Section):
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
    lora: LoraSpec = field(default_factory=LoraSpec)
    """LoRA settings."""

    def __post_init__(self) -> None:
        p = "model"
        one_of(self.kind, MODEL_KINDS, f"{p}.kind")
        one_of(self.dtype, DTYPES, f"{p}.dtype")
        one_of(self.attn_implementation, ("eager", "sdpa", "flash_attention_2"), f"{p}.attn_implementation")
        require(bool(self.preset) or bool(self.path), f"{p}.preset",
                "neither model.preset nor model.path is set", "name a preset (e.g. tiny_qwen2) or a local directory")


@dataclass
class TaskSpec(_Section):
    """Dataset + reward function + the kwargs passed to the reward function."""

    name: str = "copy_char"
    """Registered task name (copy_char | gsm8k)."""
    data_path: Optional[str] = None
    """Local JSONL/parquet file for dataset-backed tasks (gsm8k)."""
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the task's reward function, checked against its signature."""
    dataset_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the task's prompt source (e.g. the synthetic task's alphabet)."""


@dataclass
class AgentSpec(_Section):
    """A black-box agent that talks to the policy over HTTP (OpenAI `/v1/completions`) through rlspec's gateway.

    Unset (`function` and `command` both null): plain single-turn sampling. The agent gets each prompt and a
    base URL; the gateway records every completion it asks for and assembles the trajectory.
    """

    function: Optional[str] = None
    """Python agent `module:function` or `path/to/file.py:function`, called as fn(prompt, base_url) -> final answer (str)."""
    command: Optional[List[str]] = None
    """Command agent argv: reads {"prompt", "base_url"} JSON on stdin, prints {"answer": str} JSON as its last stdout line."""
    timeout_s: float = 120.0
    """An agent still running after this long is a failed trajectory (a command is killed; a function is abandoned)."""
    max_turns: int = 8
    """Completion requests one trajectory may make; the gateway refuses more and the trajectory fails."""
    concurrency: int = 8
    """Trajectories whose agents run at the same time (the engine serves their requests one at a time)."""
    max_failure_rate: float = 0.25
    """A step whose share of failed trajectories (raised, timed out, invalid) exceeds this fails the run."""

    @property
    def enabled(self) -> bool:
        return self.function is not None or self.command is not None

    def __post_init__(self) -> None:
        p = "rollout.agent"
        require(self.function is None or self.command is None, f"{p}.function",
                "both rollout.agent.function and rollout.agent.command are set", "set only one of them")
        if self.function is not None:
            module, _, name = self.function.rpartition(":")
            require(bool(module) and name.isidentifier(), f"{p}.function",
                    f"{self.function!r} is not of the form module:function or path/to/file.py:function",
                    "e.g. examples/agents/gsm8k_calc.py:solve or mypackage.agents:solve")
        if self.command is not None:
            require(len(self.command) > 0 and all(isinstance(a, str) and a for a in self.command), f"{p}.command",
                    "must be a non-empty list of non-empty strings", "e.g. [python, examples/agents/gsm8k_calc.py]")
        _positive(self.timeout_s, f"{p}.timeout_s")
        _positive(self.max_turns, f"{p}.max_turns")
        _positive(self.concurrency, f"{p}.concurrency")
        require(0 <= self.max_failure_rate <= 1, f"{p}.max_failure_rate", f"must be in [0, 1], got {self.max_failure_rate}",
                "e.g. 0.25; 0 fails the run on the first failed trajectory")


@dataclass
class RolloutSpec(_Section):
    """How completions are sampled."""

    engine: str = "hf"
    """Rollout engine: hf (transformers, batched sampling) | vllm."""
    task: TaskSpec = field(default_factory=TaskSpec)
    """The task: prompts and reward."""
    prompts_per_step: int = 8
    """Prompts per rollout batch; the batch holds prompts_per_step * algorithm.group_size sequences."""
    max_new_tokens: int = 32
    """Completion length budget (also Dr. GRPO's constant normaliser)."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are refused with an error naming the task."""
    temperature: float = 1.0
    """Sampling temperature; trainer logprobs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    gpu_memory_fraction: float = 0.5
    """vllm: fraction of GPU memory the engine may take."""
    tensor_parallel_size: int = 1
    """vllm: tensor-parallel degree of one engine."""
    server_url: Optional[str] = None
    """hardware.rollout=separate: join the `rlspec serve` at this URL instead of starting one (its bridge token in RLSPEC_SERVE_TOKEN)."""
    request_timeout_s: float = 600.0
    """A rollout-server request (one generation batch) that takes longer fails the run."""
    agent: AgentSpec = field(default_factory=AgentSpec)
    """Multi-turn black-box agent (unset: plain single-turn sampling)."""

    def __post_init__(self) -> None:
        p = "rollout"
        one_of(self.engine, ENGINES, f"{p}.engine")
        _positive(self.prompts_per_step, f"{p}.prompts_per_step")
        _positive(self.max_new_tokens, f"{p}.max_new_tokens")
        _positive(self.max_prompt_tokens, f"{p}.max_prompt_tokens")
        _positive(self.temperature, f"{p}.temperature")
        require(0 < self.top_p <= 1, f"{p}.top_p", f"must be in (0, 1], got {self.top_p}", "use 1.0 to sample from the full distribution")
        require(0 < self.gpu_memory_fraction <= 1, f"{p}.gpu_memory_fraction",
                f"must be in (0, 1], got {self.gpu_memory_fraction}", "e.g. 0.5")
        _positive(self.tensor_parallel_size, f"{p}.tensor_parallel_size")
        if self.server_url is not None:
            require(self.server_url.startswith(("http://", "https://")), f"{p}.server_url",
                    f"{self.server_url!r} is not an http(s) URL", "e.g. http://127.0.0.1:8000, or null to start a server")
        _positive(self.request_timeout_s, f"{p}.request_timeout_s")


@dataclass
class SyncSpec(_Section):
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
        _positive(self.bucket_mb, f"{p}.bucket_mb")
        _positive(self.every_n_steps, f"{p}.every_n_steps")
        _positive(self.timeout_s, f"{p}.timeout_s")


@dataclass
class HardwareSpec(_Section):
    """Where things run."""

    device: str = "cpu"
    """cpu | cuda."""
    num_trainer_ranks: int = 1
    """Data-parallel trainer ranks (processes)."""
    num_rollout_engines: int = 1
    """Rollout engine replicas (multi-process backends)."""
    rollout: str = "colocated"
    """colocated (engines share the trainer's devices) | separate (engines on their own devices)."""
    offload_params: bool = False
    """Keep sharded parameters in host memory between uses (ZeRO-3 / FSDP CPU offload)."""
    offload_optimizer: bool = False
    """Keep optimizer state in host memory."""
    ray_address: Optional[str] = None
    """Ray cluster to join; null starts a local one."""
    num_threads: int = 0
    """torch intra-op threads per process on CPU; 0 leaves torch's default."""

    def __post_init__(self) -> None:
        p = "hardware"
        one_of(self.device, DEVICES, f"{p}.device")
        _positive(self.num_trainer_ranks, f"{p}.num_trainer_ranks")
        _positive(self.num_rollout_engines, f"{p}.num_rollout_engines")
        one_of(self.rollout, PLACEMENTS, f"{p}.rollout")
        _non_negative(self.num_threads, f"{p}.num_threads")


@dataclass
class CheckpointSpec(_Section):
    """When and what to save under OUT/checkpoints/."""

    every_n_steps: int = 0
    """Save every N steps (0: only at the end); the final step is always saved."""
    keep_last: int = 2
    """Keep this many most recent checkpoints (0 keeps all)."""
    save_optimizer: bool = True
    """Also save optimizer state so a run can resume exactly."""

    def __post_init__(self) -> None:
        _non_negative(self.every_n_steps, "checkpoint.every_n_steps")
        _non_negative(self.keep_last, "checkpoint.keep_last")


@dataclass
class Spec(_Section):
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
    backend: str = "standalone"
    """Trainer backend (deepspeed | fsdp | standalone); `--backend` on the CLI overrides it."""
