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
ROLLOUT_MODES = ("sync", "async")
TASK_REWARDS = ("task", "llm_judge")
SYNC_METHODS = ("auto", "shared", "nccl", "ray", "cuda_ipc", "checkpoint", "lora")
DEVICES = ("cpu", "cuda")
PLACEMENTS = ("colocated", "separate")
STALL_ACTIONS = ("fail", "warn")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
ENV_NAMES = ("minigrid",)
ENV_REWARDS = ("success", "minigrid")


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
    tokens (`rlspec.core.packing` states the rule). 0 = off: `micro_batch_size` sequences per micro-batch.
    The no-gradient log-prob passes keep `micro_batch_size`."""
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
        if self.tis_cap is not None:
            require(math.isfinite(self.tis_cap) and self.tis_cap >= 1, f"{p}.tis_cap", f"must be a finite number >= 1, got {self.tis_cap}",
                    "a cap below 1 would down-weight on-policy tokens too; use 2.0 (a common value) or null to disable")
        _non_negative(self.kl_coef, f"{p}.kl_coef")
        one_of(self.kl_estimator, KL_ESTIMATORS, f"{p}.kl_estimator")
        one_of(self.loss_agg, LOSS_AGGS, f"{p}.loss_agg")
        one_of(self.adv_norm, ADV_NORMS, f"{p}.adv_norm")
        _positive(self.adv_eps, f"{p}.adv_eps")
        _positive(self.micro_batch_size, f"{p}.micro_batch_size")
        _non_negative(self.micro_batch_tokens, f"{p}.micro_batch_tokens")
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
    compile_layers: bool = False
    """`torch.compile` each decoder layer for the train forward/backward (regional compilation, dynamic shapes so
    packed lengths do not recompile; `rlspec.core.policy.CompiledBlocks`); causal_lm on the standalone and fsdp
    backends. The first step pays the compile (tens of seconds); off by default."""
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


DEFAULT_JUDGE_PROMPT = (
    "You grade an answer. Task:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "Rate how well the answer solves the task, from 0 (wrong) to 1 (fully correct). "
    "Reply with one line: SCORE: <number>"
)


@dataclass
class JudgeSpec(_Section):
    """A hosted LLM that scores completions (`rollout.task.reward: llm_judge`), over an OpenAI-compatible API."""

    base_url: Optional[str] = None
    """API root, e.g. https://api.openai.com/v1; requests go to {base_url}/chat/completions."""
    models: List[str] = field(default_factory=list)
    """Model fallback chain: the first is asked; the next when a model is not found or keeps failing."""
    api_key_env: Optional[str] = "OPENAI_API_KEY"
    """Environment variable holding the API key (sent as a bearer token; never logged or saved); null sends none."""
    prompt_template: str = DEFAULT_JUDGE_PROMPT
    """Judge prompt; {prompt}, {completion} and the task prompt's metadata fields (e.g. {answer}) are filled in."""
    score_regex: str = r"SCORE:\s*([-+]?\d*\.?\d+)"
    """Regular expression whose first group is the score in the judge's reply (the last match counts)."""
    max_tokens: int = 64
    """Reply length budget of the judge (sampled at temperature 0)."""
    timeout_s: float = 30.0
    """Per-request timeout (connect and read)."""
    max_retries: int = 3
    """Retries per model after a transient failure (5xx, 429, timeout, connection error, malformed reply)."""
    backoff_s: float = 0.5
    """Delay before the first retry; it doubles with each retry, up to backoff_max_s."""
    backoff_max_s: float = 8.0
    """Largest delay between retries."""
    jitter: float = 0.5
    """Each delay is multiplied by a uniform draw from [1 - jitter, 1] (1.0 is full jitter), so clients spread out."""
    max_concurrency: int = 8
    """Requests in flight at once while a batch is scored."""

    def __post_init__(self) -> None:
        p = "rollout.task.judge"
        if self.base_url is not None:
            require(self.base_url.startswith(("http://", "https://")), f"{p}.base_url",
                    f"{self.base_url!r} is not an http(s) URL", "e.g. https://api.openai.com/v1")
        require(all(isinstance(m, str) and m for m in self.models), f"{p}.models", "holds an empty model name",
                "list model names, e.g. [gpt-4o-mini, gpt-4.1-mini]")
        if self.api_key_env is not None:
            require(bool(self.api_key_env), f"{p}.api_key_env", "is empty", "name an environment variable, or null for no key")
        _positive(self.max_tokens, f"{p}.max_tokens")
        _positive(self.timeout_s, f"{p}.timeout_s")
        _non_negative(self.max_retries, f"{p}.max_retries")
        _non_negative(self.backoff_s, f"{p}.backoff_s")
        require(self.backoff_max_s >= self.backoff_s, f"{p}.backoff_max_s",
                f"{self.backoff_max_s} is below judge.backoff_s={self.backoff_s}", "set it to at least backoff_s")
        require(0 <= self.jitter <= 1, f"{p}.jitter", f"must be in [0, 1], got {self.jitter}", "0.5 is a common value")
        _positive(self.max_concurrency, f"{p}.max_concurrency")


@dataclass
class TaskSpec(_Section):
    """Dataset + reward function + the kwargs passed to the reward function."""

    name: str = "copy_char"
    """Registered task name (copy_char | gsm8k)."""
    data_path: Optional[str] = None
    """Local JSONL/parquet file for dataset-backed tasks (gsm8k)."""
    reward: str = "task"
    """Who scores completions: task (the task's own reward function) | llm_judge (a remote judge, see `judge`)."""
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the task's reward function, checked against its signature."""
    dataset_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the task's prompt source (e.g. the synthetic task's alphabet)."""
    judge: JudgeSpec = field(default_factory=JudgeSpec)
    """The remote judge (only read when reward is llm_judge)."""
    max_reward_error_rate: float = 0.0
    """Fraction of a step's samples whose reward may fail (raise, or not a finite number) before the run fails; failed samples are dropped."""

    def __post_init__(self) -> None:
        p = "rollout.task"
        one_of(self.reward, TASK_REWARDS, f"{p}.reward")
        require(0 <= self.max_reward_error_rate <= 1, f"{p}.max_reward_error_rate",
                f"must be in [0, 1], got {self.max_reward_error_rate}", "e.g. 0.05 to tolerate a few failed judge calls")
        if self.reward == "llm_judge":
            require(self.judge.base_url is not None, f"{p}.judge.base_url", "is not set but rollout.task.reward=llm_judge",
                    "set it to the judge's OpenAI-compatible API root, e.g. https://api.openai.com/v1")
            require(len(self.judge.models) > 0, f"{p}.judge.models", "is empty but rollout.task.reward=llm_judge",
                    "list at least one model; later ones are fallbacks")
            require(not self.reward_kwargs, f"{p}.reward_kwargs", "are for the task's own reward, but rollout.task.reward=llm_judge",
                    "configure the judge under rollout.task.judge and remove them (on the command line: "
                    + " ".join(f"~{p}.reward_kwargs.{k}" for k in self.reward_kwargs) + ")")


@dataclass
class EnvSpec(_Section):
    """An environment the policy acts in (`model.kind: vla`); unset (`name: null`) for text tasks."""

    name: Optional[str] = None
    """Registered environment: minigrid (MiniGrid and BabyAI levels); null means text prompts from `rollout.task`."""
    level: str = "BabyAI-GoToRedBallNoDists-v0"
    """The gymnasium id of the level (any registered MiniGrid-* or BabyAI-* id)."""
    max_steps: int = 0
    """Steps before an episode is truncated (counted as `env/truncated`, reward 0); 0 keeps the level's own limit."""
    reward: str = "success"
    """success: 1 on success else 0 | minigrid: the level's 1 - 0.9 * steps / max_steps on success else 0."""
    num_actions: int = 0
    """Use only the level's first N actions (3: MiniGrid's left, right, forward, all a navigation level needs); 0 keeps all."""
    tile_size: int = 8
    """Pixels per grid cell of the egocentric 7x7-cell RGB view (8 gives 56x56 images)."""
    prompt_template: str = "{image}{instruction}\n"
    """Prompt text per step: `{image}` becomes the processor's image token, `{instruction}` the mission."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for `gymnasium.make` of the level."""

    def __post_init__(self) -> None:
        p = "rollout.env"
        if self.name is not None:
            one_of(self.name, ENV_NAMES, f"{p}.name")
        require(bool(self.level), f"{p}.level", "is empty", "name a level, e.g. BabyAI-GoToRedBallNoDists-v0")
        _non_negative(self.max_steps, f"{p}.max_steps")
        one_of(self.reward, ENV_REWARDS, f"{p}.reward")
        _non_negative(self.num_actions, f"{p}.num_actions")
        _positive(self.tile_size, f"{p}.tile_size")
        for key in ("{image}", "{instruction}"):
            require(key in self.prompt_template, f"{p}.prompt_template", f"has no {key}",
                    "write a template such as '{image}{instruction}\\n'")


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
    """A rollout-server request (one generation batch) that takes longer fails the run."""
    server_start_timeout_s: float = 300.0
    """A rollout server (started or joined) that is not healthy within this many seconds fails the run."""
    server_reconnect_s: float = 60.0
    """A rollout server lost mid-run (connections refused or dropped): wait this long for it (a joined one) or a restarted one
    (one the run started) to be healthy, push the current weights and re-run the interrupted requests; 0 fails at once."""
    agent: AgentSpec = field(default_factory=AgentSpec)
    """Multi-turn black-box agent (unset: plain single-turn sampling)."""

    def __post_init__(self) -> None:
        p = "rollout"
        one_of(self.engine, ENGINES, f"{p}.engine")
        _positive(self.prompts_per_step, f"{p}.prompts_per_step")
        _positive(self.max_new_tokens, f"{p}.max_new_tokens")
        _positive(self.decode_slots, f"{p}.decode_slots")
        _positive(self.max_prompt_tokens, f"{p}.max_prompt_tokens")
        _positive(self.temperature, f"{p}.temperature")
        require(0 < self.top_p <= 1, f"{p}.top_p", f"must be in (0, 1], got {self.top_p}", "use 1.0 to sample from the full distribution")
        require(0 < self.gpu_memory_fraction <= 1, f"{p}.gpu_memory_fraction",
                f"must be in (0, 1], got {self.gpu_memory_fraction}", "e.g. 0.5")
        _positive(self.tensor_parallel_size, f"{p}.tensor_parallel_size")
        one_of(self.mode, ROLLOUT_MODES, f"{p}.mode")
        _non_negative(self.max_staleness, f"{p}.max_staleness")
        if self.server_url is not None:
            require(self.server_url.startswith(("http://", "https://")), f"{p}.server_url",
                    f"{self.server_url!r} is not an http(s) URL", "e.g. http://127.0.0.1:8000, or null to start a server")
        for i, url in enumerate(self.server_urls):
            require(isinstance(url, str) and url.startswith(("http://", "https://")), f"{p}.server_urls[{i}]",
                    f"{url!r} is not an http(s) URL", "e.g. [http://127.0.0.1:8000, http://127.0.0.1:8001], or [] to start them")
        require(len(set(self.server_urls)) == len(self.server_urls), f"{p}.server_urls", "a server is listed twice",
                "list each server once")
        _positive(self.request_timeout_s, f"{p}.request_timeout_s")
        _positive(self.server_start_timeout_s, f"{p}.server_start_timeout_s")
        _non_negative(self.server_reconnect_s, f"{p}.server_reconnect_s")


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
class DeepSpeedSpec(_Section):
    """ZeRO-3 communication knobs of the `deepspeed` backend (`backends/deepspeed/README.md` says what each trades).

    Sizes are element counts (parameters or gradient values), as DeepSpeed counts them, not bytes. Other backends
    ignore this section.
    """

    overlap_comm: bool = False
    """Overlap gradient reduce-scatter with the backward (DeepSpeed's `overlap_comm`); costs extra bucket memory."""
    contiguous_gradients: bool = True
    """Copy reduced gradients into one contiguous buffer as they are produced (`contiguous_gradients`)."""
    reduce_bucket_numel: int = 50_000_000
    """Gradient values reduced per collective (`reduce_bucket_size`)."""
    prefetch_bucket_numel: int = 50_000_000
    """Parameter values gathered ahead of use (`stage3_prefetch_bucket_size`); 0 turns prefetching off."""
    param_persistence_numel: int = 100_000
    """Parameters with fewer values stay whole on every rank, never partitioned (`stage3_param_persistence_threshold`)."""
    max_live_numel: int = 1_000_000_000
    """Gathered parameter values a rank keeps at once before releasing some (`stage3_max_live_parameters`)."""

    def __post_init__(self) -> None:
        p = "hardware.deepspeed"
        _positive(self.reduce_bucket_numel, f"{p}.reduce_bucket_numel")
        _non_negative(self.prefetch_bucket_numel, f"{p}.prefetch_bucket_numel")
        _non_negative(self.param_persistence_numel, f"{p}.param_persistence_numel")
        _positive(self.max_live_numel, f"{p}.max_live_numel")


@dataclass
class FSDPSpec(_Section):
    """FSDP2 knobs of the `fsdp` backend (`backends/fsdp/README.md`). Other backends ignore this section."""

    reshard_after_forward: Optional[bool] = None
    """Free each block's gathered parameters after its forward and gather them again for its backward (FSDP2's
    `reshard_after_forward`): less memory for one more all-gather per block and micro-batch. False keeps each
    gathered block until the step's last backward (one gather per block and step, the whole model gathered at
    once). null (default): true with more than one trainer rank, false with one, where the gather is a copy of
    what the rank holds anyway and keeping it only costs the 16-bit copy of the weights."""


@dataclass
class HardwareSpec(_Section):
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
    """Keep sharded parameters in host memory between uses (ZeRO-3 / FSDP CPU offload)."""
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
    stall_action: str = "fail"
    """What a stall does after the dump: fail (exit 1) | warn (keep waiting, dump again after another timeout)."""
    preempt_grace_s: float = 30.0
    """After SIGTERM/SIGINT, the time the run has to finish (or abandon) its step and checkpoint it; past it the
    run exits 143 without that checkpoint (the previous one stays the latest). Schedulers kill after their own
    grace (Slurm's KillWait, 30 s; Kubernetes' terminationGracePeriodSeconds): keep this below theirs."""
    deepspeed: DeepSpeedSpec = field(default_factory=DeepSpeedSpec)
    """ZeRO-3 bucket, prefetch and overlap settings (the `deepspeed` backend only)."""
    fsdp: FSDPSpec = field(default_factory=FSDPSpec)
    """FSDP2 settings (the `fsdp` backend only)."""

    def __post_init__(self) -> None:
        p = "hardware"
        _positive(self.preempt_grace_s, f"{p}.preempt_grace_s")
        _finite(self.preempt_grace_s, f"{p}.preempt_grace_s")
        one_of(self.device, DEVICES, f"{p}.device")
        _positive(self.num_trainer_ranks, f"{p}.num_trainer_ranks")
        _positive(self.num_rollout_engines, f"{p}.num_rollout_engines")
        one_of(self.rollout, PLACEMENTS, f"{p}.rollout")
        one_of(self.placement_strategy, PLACEMENT_STRATEGIES, f"{p}.placement_strategy")
        _non_negative(self.num_threads, f"{p}.num_threads")
        _non_negative(self.stall_timeout_s, f"{p}.stall_timeout_s")
        _finite(self.stall_timeout_s, f"{p}.stall_timeout_s")
        one_of(self.stall_action, STALL_ACTIONS, f"{p}.stall_action")


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
