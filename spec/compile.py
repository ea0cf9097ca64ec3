"""Spec -> RunPlan: every derived value computed once, impossible combinations refused.

The compiler is pure: it sees the backends only through their `BackendCaps` (what each can run), so a
plan can be compiled and printed without importing DeepSpeed or starting Ray.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from .errors import require
from .evaluation import check_eval, check_eval_cadence
from .schema import Spec


@dataclass(frozen=True)
class BackendCaps:
    """What a backend can run; declared by the backend class, read by the compiler."""

    name: str
    model_kinds: tuple[str, ...] = ("causal_lm",)
    placements: tuple[str, ...] = ("colocated",)
    sync_methods: tuple[str, ...] = ("checkpoint",)
    engines: tuple[str, ...] = ("hf",)
    devices: tuple[str, ...] = ("cpu", "cuda")
    supports_lora: bool = False
    compiles_layers: bool = False
    """Honours `model.compile_layers`."""
    max_trainer_ranks: int = 1_000_000
    single_process: bool = False
    """Trainer and engine live in one process (the only case where `sync.method=shared` is possible)."""
    keeps_master_weights: bool = False
    """Below fp32 weights (`model.dtype`), the optimizer steps fp32 master weights, which checkpoints carry."""
    requires: tuple[str, ...] = ()
    """Importable modules the backend needs at run time (checked before a run writes anything)."""
    install_hint: str = ""
    """How to install them, e.g. pip install 'rlspec[deepspeed]'."""


@dataclass(frozen=True)
class BatchPlan:
    """The batch-size arithmetic, resolved."""

    prompts_per_step: int
    group_size: int
    sequences_per_step: int
    num_trainer_ranks: int
    updates_per_batch: int
    sequences_per_update: int
    """Global mini-batch: sequences behind one optimizer step."""
    sequences_per_update_per_rank: int
    micro_batch_size: int
    grad_accum_steps: int
    """Micro-batches per optimizer step on one rank."""
    max_tokens_per_sequence: int
    max_trained_tokens: int
    """Most loss (sampled) tokens one sequence can hold, Dr. GRPO's constant L_max (`rlspec.core.grpo`):
    rollout.max_new_tokens; with rollout.agent every turn's sampled tokens are trained, so
    rollout.agent.max_turns x rollout.max_new_tokens."""


@dataclass(frozen=True)
class Placement:
    """Which device runs what."""

    device: str
    rollout: str
    trainer_devices: tuple[str, ...]
    engine_devices: tuple[str, ...]
    num_gpus: int


@dataclass(frozen=True)
class Sharding:
    """How the trainer ranks hold the model, resolved from the backend's knobs and the model's size."""

    num_parameters: Optional[int]
    """The policy's parameter count from its preset or config.json (`rlspec.models.presets.parameter_count`); null
    where the plan cannot tell (a vision-language model)."""
    zero_stage: Optional[int]
    """The `deepspeed` backend's ZeRO stage (`hardware.deepspeed.zero_stage`, or the plan's pick where it is null)."""
    reshard_after_forward: Optional[bool]
    """The `fsdp` backend's FSDP2 `reshard_after_forward` (`hardware.fsdp.reshard_after_forward`, or the plan's pick
    from the model's size where it is null)."""
    why: str
    """The reason for the choice, in words."""


@dataclass(frozen=True)
class Dispatch:
    """How a step's prompts reach several rollout engines (`rlspec.cluster.dispatch`)."""

    method: str
    """queue (chunks taken by whichever engine is free) | split (one fixed run per engine)."""
    chunk_prompts: int
    """queue: prompts (groups) per chunk (`rollout.dispatch_chunk_prompts`, or decode_slots // group_size, at most
    an engine's share of the step's prompts)."""
    why: str
    """The reason, in words."""


@dataclass(frozen=True)
class RunPlan:
    """The frozen, fully resolved run: what `rlspec plan` prints and `Backend.setup` receives."""

    backend: str
    spec: Spec
    batch: BatchPlan
    placement: Placement
    sync_method: str
    needs_reference_model: bool
    generation_path: str
    """How each rollout engine generates: `cuda_graph` (the hf engine's CUDA-graph sampler), `plain (<why>)`
    (transformers' forward in the hf engine's own loop), or the engine's name (vllm); from the model type
    (`rlspec.models.presets.generation_path`), read from the preset or the model directory's config.json."""
    sharding: Sharding
    """How the trainer ranks hold the model (`_sharding`)."""
    dispatch: Dispatch
    """How a step's prompts reach the rollout engines (`_dispatch`)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)


def compile_plan(spec: Spec, backends: Mapping[str, BackendCaps]) -> RunPlan:
    """Resolve `spec` for the backend it names, given the capabilities of all registered backends."""
    require(spec.backend in backends, "backend", f"{spec.backend!r} is not a registered backend",
            f"use one of: {', '.join(sorted(backends))} (or --backend NAME)")
    caps = backends[spec.backend]
    _check_support(spec, caps, backends)
    _check_deepspeed(spec)
    _check_env(spec)
    batch = _batch_plan(spec)
    placement = _placement(spec)
    sync_method = _resolve_sync(spec, caps)
    _check_async(spec, sync_method)
    _check_free_during_train(spec, caps, sync_method)
    _check_files(spec)
    check_eval(spec.eval, spec.rollout.task, spec.checkpoint.keep_best)
    check_eval_cadence(spec.eval, spec.sync.every_n_steps, spec.algorithm.steps)
    spec.freeze()
    return RunPlan(backend=spec.backend, spec=spec, batch=batch, placement=placement,
                   sync_method=sync_method, needs_reference_model=spec.algorithm.kl_coef > 0,
                   generation_path=_generation_path(spec, placement, sync_method), sharding=_sharding(spec),
                   dispatch=_dispatch(spec))


def _dispatch(spec: Spec) -> Dispatch:
    """`rollout.dispatch` resolved (`auto`): queue where several engines each get more samples of a step than their
    `rollout.decode_slots` (they run in waves anyway); split otherwise, for one engine, and for environments
    (`model.kind=vla`: each engine keeps the environments of its own groups)."""
    rollout, engines, group = spec.rollout, spec.hardware.num_rollout_engines, spec.algorithm.group_size
    vla = spec.model.kind == "vla"
    require(not (vla and rollout.dispatch == "queue"), "rollout.dispatch",
            "model.kind=vla keeps each engine's environments for its own groups, so its groups cannot move between "
            "engines", "set rollout.dispatch=auto or split")
    # A chunk fills an engine's slots, but never holds more than an engine's share of the step: a chunk of every
    # prompt would leave the other engines idle (2 H200s, rollout.dispatch=queue, 16 prompts a step: engine 0 took
    # all 16 in one chunk of decode_slots // group_size = 32)
    share_prompts = -(-rollout.prompts_per_step // engines)
    chunk = rollout.dispatch_chunk_prompts or max(1, min(rollout.decode_slots // group, share_prompts))
    if engines == 1:
        return Dispatch("split", chunk, "one rollout engine takes the whole step")
    if rollout.dispatch != "auto":
        return Dispatch(rollout.dispatch, chunk, "rollout.dispatch as set")
    if vla:
        return Dispatch("split", chunk, "model.kind=vla: each engine keeps the environments of its own groups")
    share = share_prompts * group
    if share <= rollout.decode_slots:
        return Dispatch("split", chunk, f"each engine's {share} samples fit its rollout.decode_slots "
                                        f"{rollout.decode_slots}: all start at once (a queue would run its chunks' "
                                        "tails one after another)")
    return Dispatch("queue", chunk, f"each engine's {share} samples exceed its rollout.decode_slots "
                                    f"{rollout.decode_slots}: chunks of {chunk} prompts, each engine taking the next "
                                    "when it finishes one")


def _sharding(spec: Spec) -> Sharding:
    """The ZeRO stage (deepspeed) or FSDP2 resharding (fsdp), each as set or, where null, picked here (FSDP2 keeps a
    model gathered through the update where its 16-bit weights fit `hardware.fsdp.gathered_max_gb`). ZeRO-1 keeps
    the 16-bit weights and gradients whole on every rank (4 bytes a parameter): where that fits in
    `hardware.deepspeed.zero1_max_gb` nothing is gathered in the forward, backward or push, and only the optimizer
    state is partitioned (measured faster than ZeRO-3 on 1 and 2 GPUs, `docs/multigpu.md`)."""
    from ..models.presets import parameter_count

    hw, world = spec.hardware, spec.hardware.num_trainer_ranks
    count = parameter_count(model_config(spec)) if spec.model.kind == "causal_lm" else None
    if spec.backend == "deepspeed":
        stage, gb = hw.deepspeed.zero_stage, (count or 0) * 4 / 2**30
        if stage is not None:
            why = "hardware.deepspeed.zero_stage as set"
        elif hw.offload_params:
            stage, why = 3, "ZeRO-3: hardware.offload_params needs it"
        elif count is None:
            stage, why = 3, "ZeRO-3: the model's size is not known to the plan"
        elif gb <= hw.deepspeed.zero1_max_gb:
            stage, why = 1, (f"ZeRO-1: 16-bit weights and gradients {gb:.2f} GB <= hardware.deepspeed.zero1_max_gb "
                             f"{hw.deepspeed.zero1_max_gb:g} on every rank")
        else:
            stage, why = 3, (f"ZeRO-3: 16-bit weights and gradients {gb:.2f} GB > hardware.deepspeed.zero1_max_gb "
                             f"{hw.deepspeed.zero1_max_gb:g}")
        return Sharding(count, stage, None, why)
    if spec.backend == "fsdp":
        reshard, gb = hw.fsdp.reshard_after_forward, (count or 0) * 2 / 2**30
        if reshard is not None:
            return Sharding(count, None, reshard, "hardware.fsdp.reshard_after_forward as set")
        if world == 1:
            return Sharding(count, None, False, "one trainer rank: the gather is a copy of what the rank holds, kept "
                                                "through the update")
        if count is not None and gb <= hw.fsdp.gathered_max_gb:
            return Sharding(count, None, False, f"kept gathered through the update: 16-bit weights {gb:.2f} GB <= "
                                                f"hardware.fsdp.gathered_max_gb {hw.fsdp.gathered_max_gb:g}")
        size = "not known to the plan" if count is None else f"{gb:.2f} GB > hardware.fsdp.gathered_max_gb"
        return Sharding(count, None, True, f"each block gathered for its forward and again for its backward: 16-bit "
                                           f"weights {size}")
    return Sharding(count, None, None, "one process holds the whole model")


def _generation_path(spec: Spec, placement: "Placement", sync_method: str) -> str:
    from ..models.presets import generation_path  # plain data: no torch

    if spec.model.kind == "vla":
        return "plain (model.kind=vla: actions from its forward, one step of each episode at a time)"
    return generation_path(_model_type(spec), placement.device, spec.rollout.cuda_graph, spec.rollout.engine,
                           lora_engine=sync_method == "lora")


def _model_type(spec: Spec) -> str | None:
    """The model type of `model.path`'s config.json (checked readable by `_check_files`, parsed again where the model
    is built), or of `model.preset`; None where neither says."""
    return model_config(spec).get("model_type")


def model_config(spec: Spec) -> dict:
    """`model.path`'s config.json as a dict, or `model.preset`'s; empty where neither can be read (an unreadable
    config is refused by name where the model is checked, `check_model_spec`)."""
    from ..models.presets import PRESETS

    model = spec.model
    if model.path is None:
        return dict(PRESETS.get(model.preset, {}))
    try:
        config = json.loads((Path(model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _supporters(backends: Mapping[str, BackendCaps], ok) -> str:
    names = sorted(name for name, caps in backends.items() if ok(caps))
    return ", ".join(names) if names else "none yet"


def _check_support(spec: Spec, caps: BackendCaps, backends: Mapping[str, BackendCaps]) -> None:
    hw, model = spec.hardware, spec.model
    require(model.kind in caps.model_kinds, "model.kind",
            f"model.kind={model.kind} is not supported by backend {caps.name}",
            f"backends that support it: {_supporters(backends, lambda c: model.kind in c.model_kinds)}")
    require(model.lora.r == 0 or caps.supports_lora, "model.lora.r",
            f"LoRA is not supported by backend {caps.name}",
            f"set model.lora.r=0, or use one of: {_supporters(backends, lambda c: c.supports_lora)}")
    require(not model.compile_layers or caps.compiles_layers, "model.compile_layers",
            f"regional compilation is not wired into backend {caps.name}",
            f"set model.compile_layers=false, or use one of: {_supporters(backends, lambda c: c.compiles_layers)}")
    require(hw.rollout in caps.placements, "hardware.rollout",
            f"hardware.rollout={hw.rollout} is not supported by backend {caps.name}",
            f"use one of: {', '.join(caps.placements)}")
    require(hw.device in caps.devices, "hardware.device",
            f"hardware.device={hw.device} is not supported by backend {caps.name}", f"use one of: {', '.join(caps.devices)}")
    require(hw.num_trainer_ranks <= caps.max_trainer_ranks, "hardware.num_trainer_ranks",
            f"backend {caps.name} runs at most {caps.max_trainer_ranks} trainer rank(s), got {hw.num_trainer_ranks}",
            f"set hardware.num_trainer_ranks={caps.max_trainer_ranks} or use a distributed backend "
            f"({_supporters(backends, lambda c: c.max_trainer_ranks > 1)})")
    engine = spec.rollout.engine
    require(engine in caps.engines, "rollout.engine",
            f"rollout.engine={engine} is not supported by backend {caps.name}",
            f"use one of: {', '.join(caps.engines)}; backends with it: {_supporters(backends, lambda c: engine in c.engines)}")
    require(not (engine == "vllm" and hw.device == "cpu"), "rollout.engine",
            "rollout.engine=vllm needs hardware.device=cuda", "use rollout.engine=hf on CPU")
    require(not (model.dtype == "float16" and hw.device == "cpu"), "model.dtype",
            "float16 is not supported on CPU", "use model.dtype=float32 or bfloat16 on CPU")
    require(spec.rollout.server_url is None or hw.rollout == "separate", "rollout.server_url",
            "joining a rollout server needs hardware.rollout=separate", "set hardware.rollout=separate or unset rollout.server_url")
    _check_servers(spec, caps)
    require(not spec.rollout.agent.enabled or hw.num_trainer_ranks == 1, "rollout.agent",
            "an agent's failed trajectories are dropped, so its batch size varies and cannot be split evenly over "
            f"{hw.num_trainer_ranks} trainer ranks", "set hardware.num_trainer_ranks=1 with rollout.agent")
    require(not spec.rollout.agent.enabled or spec.rollout.mode == "sync", "rollout.agent",
            "agents run in the synchronous loop; rollout.mode=async does not drive them yet",
            "set rollout.mode=sync with rollout.agent")
    require(not spec.rollout.agent.enabled or spec.rollout.env.name is None, "rollout.agent",
            "an agent talks to a text model; rollout.env drives a vision-language-action policy", "unset one of them")
    require(not (hw.offload_params or hw.offload_optimizer) or hw.device == "cuda", "hardware.offload_params",
            "offloading to host memory only makes sense with hardware.device=cuda",
            "set hardware.offload_params=false and hardware.offload_optimizer=false on CPU")


def _check_deepspeed(spec: Spec) -> None:
    """`hardware.deepspeed` against the rest of `hardware`. Only the backend named deepspeed reads that section, so
    another backend's plan is not refused for it."""
    if spec.backend != "deepspeed":
        return
    hw = spec.hardware
    stage = hw.deepspeed.zero_stage
    require(not hw.offload_params or stage in (None, 3), "hardware.offload_params",
            f"hardware.offload_params=true with hardware.deepspeed.zero_stage={stage}: DeepSpeed offloads parameters "
            "only under ZeRO-3 (ZeRO-1 and ZeRO-2 keep the full weights on every rank's device)",
            "set hardware.deepspeed.zero_stage=3 to offload parameters, or hardware.offload_params=false "
            "(hardware.offload_optimizer works with every stage)")


def _check_env(spec: Spec) -> None:
    """An environment goes with a vision-language-action policy, and only with one."""
    env, kind = spec.rollout.env, spec.model.kind
    if kind != "vla":
        require(env.name is None, "rollout.env.name", f"an environment ({env.name}) needs model.kind=vla, got {kind}",
                "set model.kind=vla (and a VLA model), or rollout.env.name=null for a text task")
        return
    require(env.name is not None, "rollout.env.name", "model.kind=vla acts in an environment, but none is set",
            "set rollout.env.name=minigrid and rollout.env.level (e.g. BabyAI-GoToRedBallNoDists-v0)")
    require(spec.rollout.max_new_tokens == 1, "rollout.max_new_tokens",
            f"a VLA policy emits one action token per environment step, got {spec.rollout.max_new_tokens}",
            "set rollout.max_new_tokens=1")
    require(spec.rollout.engine == "hf", "rollout.engine", f"environment rollouts run on the hf engine, got {spec.rollout.engine}",
            "set rollout.engine=hf")
    require(spec.hardware.rollout == "colocated", "hardware.rollout",
            "environment rollouts run the policy in the trainer's process; a separate rollout server has no environments",
            "set hardware.rollout=colocated")
    require(spec.rollout.mode == "sync", "rollout.mode", "environment rollouts run synchronously",
            "set rollout.mode=sync")


def _batch_plan(spec: Spec) -> BatchPlan:
    algo, hw, rollout = spec.algorithm, spec.hardware, spec.rollout
    sequences = rollout.prompts_per_step * algo.group_size
    per_update = sequences // algo.updates_per_batch
    require(sequences % algo.updates_per_batch == 0, "algorithm.updates_per_batch",
            f"{sequences} sequences per step (rollout.prompts_per_step={rollout.prompts_per_step} x "
            f"algorithm.group_size={algo.group_size}) do not split into {algo.updates_per_batch} updates",
            f"choose a divisor of {sequences}")
    ranks = hw.num_trainer_ranks
    require(per_update % ranks == 0, "hardware.num_trainer_ranks",
            f"{per_update} sequences per update do not split evenly over {ranks} trainer ranks",
            f"choose rollout.prompts_per_step so prompts_per_step x group_size / updates_per_batch is a multiple of {ranks}")
    per_rank = per_update // ranks
    agent = rollout.agent
    if agent.enabled:
        fewest = fewest_agent_rows(rollout.prompts_per_step, algo.group_size, agent.max_failure_rate)
        require(algo.updates_per_batch <= fewest, "algorithm.updates_per_batch",
                f"an agent step may keep as few as {fewest} of its {sequences} trajectories (failures up to "
                f"rollout.agent.max_failure_rate={agent.max_failure_rate:g}, and a group left with one member is "
                f"dropped), fewer than the {algo.updates_per_batch} mini-batches to split them into",
                f"set algorithm.updates_per_batch to at most {fewest}, or lower rollout.agent.max_failure_rate")
    require(algo.micro_batch_size <= per_rank, "algorithm.micro_batch_size",
            f"{algo.micro_batch_size} is larger than the {per_rank} sequences each rank gets per update",
            f"set algorithm.micro_batch_size to at most {per_rank}")
    return BatchPlan(
        prompts_per_step=rollout.prompts_per_step, group_size=algo.group_size, sequences_per_step=sequences,
        num_trainer_ranks=ranks, updates_per_batch=algo.updates_per_batch, sequences_per_update=per_update,
        sequences_per_update_per_rank=per_rank, micro_batch_size=algo.micro_batch_size,
        grad_accum_steps=math.ceil(per_rank / algo.micro_batch_size),
        max_tokens_per_sequence=rollout.max_prompt_tokens + rollout.max_new_tokens,
        max_trained_tokens=rollout.max_new_tokens * (rollout.agent.max_turns if rollout.agent.enabled else 1),
    )


def fewest_agent_rows(prompts: int, group_size: int, max_failure_rate: float) -> int:
    """The fewest trajectories an agent step keeps without failing the run (`rlspec.agent.gateway`): up to
    `max_failure_rate` of the prompts x group_size may fail, and a group left with one member is dropped whole.
    Emptying a group takes group_size - 1 failures for group_size rows, so the fewest come from emptying all but
    one group that the failures allow, then cutting the others down towards two members each."""
    jobs = prompts * group_size
    failures = max(k for k in range(jobs + 1) if k / jobs <= max_failure_rate)  # the gateway's own test
    emptied = min(prompts - 1, failures // (group_size - 1))
    left = prompts - emptied
    return left * group_size - min(failures - emptied * (group_size - 1), left * (group_size - 2))


def _check_servers(spec: Spec, caps: BackendCaps) -> None:
    """Several engines of a single-process backend are several rollout servers (`rlspec.serve.client`)."""
    hw, urls = spec.hardware, spec.rollout.server_urls
    require(spec.rollout.server_url is None or not urls, "rollout.server_urls", "rollout.server_url and "
            "rollout.server_urls are both set", "set one: server_url for one server, server_urls for several")
    require(not urls or hw.rollout == "separate", "rollout.server_urls",
            "joining rollout servers needs hardware.rollout=separate", "set hardware.rollout=separate or unset rollout.server_urls")
    require(not urls or caps.single_process, "rollout.server_urls",
            f"backend {caps.name} runs its engines as Ray actors, not in rollout servers",
            "use backend=standalone, or unset rollout.server_urls")
    require(not urls or len(urls) == hw.num_rollout_engines, "hardware.num_rollout_engines",
            f"rollout.server_urls lists {len(urls)} server(s) but hardware.num_rollout_engines={hw.num_rollout_engines}",
            f"set hardware.num_rollout_engines={len(urls)}")
    if not caps.single_process or hw.num_rollout_engines == 1:
        return
    require(hw.rollout == "separate", "hardware.num_rollout_engines",
            f"backend {caps.name} runs {hw.num_rollout_engines} engines as rollout servers, which needs "
            "hardware.rollout=separate", "set hardware.rollout=separate, or hardware.num_rollout_engines=1")
    require(spec.sync.method != "cuda_ipc", "sync.method",
            "cuda_ipc shares the trainer's GPU memory with one process on the same GPU; several servers sit on "
            "GPUs of their own", "use sync.method=nccl (or auto) with several rollout servers")
    require(spec.rollout.server_url is None, "rollout.server_url",
            f"one server URL for hardware.num_rollout_engines={hw.num_rollout_engines}",
            "list every server in rollout.server_urls, or set hardware.num_rollout_engines=1")
    require(not spec.rollout.agent.enabled, "rollout.agent",
            "an agent's requests go to one rollout server", "set hardware.num_rollout_engines=1 with rollout.agent")
    require(spec.rollout.env.name is None, "rollout.env",
            "environment episodes are not split across rollout servers", "set hardware.num_rollout_engines=1 with rollout.env")


def _placement(spec: Spec) -> Placement:
    hw = spec.hardware
    ranks, engines = hw.num_trainer_ranks, hw.num_rollout_engines
    if hw.device == "cpu":
        return Placement("cpu", hw.rollout, ("cpu",) * ranks, ("cpu",) * engines, 0)
    tp = spec.rollout.tensor_parallel_size
    trainer = tuple(f"cuda:{i}" for i in range(ranks))
    if hw.rollout == "colocated":
        require(engines * tp <= ranks, "hardware.num_rollout_engines",
                f"{engines} colocated engine(s) x tensor_parallel_size {tp} need more GPUs than the {ranks} trainer rank(s) hold",
                f"set hardware.num_rollout_engines to at most {max(1, ranks // tp)} or use hardware.rollout=separate")
        engine = tuple(f"cuda:{i}" for i in range(engines * tp))
        return Placement("cuda", "colocated", trainer, engine, ranks)
    engine = tuple(f"cuda:{ranks + i}" for i in range(engines * tp))
    return Placement("cuda", "separate", trainer, engine, ranks + engines * tp)


def _resolve_sync(spec: Spec, caps: BackendCaps) -> str:
    method, hw = spec.sync.method, spec.hardware
    if method == "auto":
        overlapping = spec.rollout.mode == "async" and spec.rollout.max_staleness > 0
        if caps.single_process and hw.rollout == "colocated" and overlapping:
            # generation overlaps the update: the engine needs weights of its own (see `_check_async`)
            method = "cuda_ipc" if hw.device == "cuda" else "checkpoint"
        elif caps.single_process and hw.rollout == "colocated":
            method = "shared"
        elif spec.model.lora.r > 0 and "lora" in caps.sync_methods:
            method = "lora"
        elif hw.rollout == "colocated":
            method = "cuda_ipc" if hw.device == "cuda" else "ray"
        else:
            method = "nccl"
        if method not in caps.sync_methods:
            method = caps.sync_methods[0]
        return method
    require(method in caps.sync_methods, "sync.method", f"sync.method={method} is not supported by backend {caps.name}",
            f"use one of: auto, {', '.join(caps.sync_methods)}")
    require(method != "shared" or (caps.single_process and hw.rollout == "colocated"), "sync.method",
            "sync.method=shared needs trainer and engine in one process",
            "it works with backend=standalone and hardware.rollout=colocated; use sync.method=auto")
    require(method != "cuda_ipc" or (hw.rollout == "colocated" and hw.device == "cuda"), "sync.method",
            "sync.method=cuda_ipc needs hardware.rollout=colocated and hardware.device=cuda",
            "set both, or use sync.method=auto")
    require(not (method == "nccl" and hw.rollout == "colocated" and hw.device == "cuda"), "sync.method",
            "sync.method=nccl with hardware.rollout=colocated puts both ends of one communicator on one GPU, which NCCL refuses",
            "use sync.method=auto (cuda_ipc), or hardware.rollout=separate")
    require(method != "lora" or spec.model.lora.r > 0, "sync.method",
            "sync.method=lora moves only adapters, but model.lora.r=0", "set model.lora.r > 0 or use sync.method=auto")
    return method


def _check_async(spec: Spec, sync_method: str) -> None:
    """What may overlap in `rollout.mode=async`: generation runs while the trainer updates its weights."""
    rollout, every = spec.rollout, spec.sync.every_n_steps
    if rollout.mode != "async":
        return
    require(rollout.max_staleness == 0 or sync_method != "shared", "rollout.max_staleness",
            f"rollout.mode=async with rollout.max_staleness={rollout.max_staleness} would generate while the trainer "
            "updates the weights, but sync.method=shared makes the engine and the trainer one module (generation would "
            "read half-updated weights)",
            "give the engine its own weights: sync.method=checkpoint (standalone), or a backend whose engines run in "
            "their own processes (backend=deepspeed); or set rollout.max_staleness=0")
    require(rollout.max_staleness >= every - 1, "rollout.max_staleness",
            f"the engine receives weights only every sync.every_n_steps={every} steps, so batches lag up to {every - 1} "
            f"policy versions, more than rollout.max_staleness={rollout.max_staleness} allows (the rollout loop would wait forever)",
            f"set rollout.max_staleness >= {every - 1} or lower sync.every_n_steps")


def _check_free_during_train(spec: Spec, caps: BackendCaps, sync_method: str) -> None:
    """An engine that gives its weights back for the train phase gets them again from the push before its next
    rollout: there must be one, of the full weights, and no rollout during the train phase."""
    rollout = spec.rollout
    if rollout.free_during_train != "kv_cache_and_weights":
        return
    key, fix = "rollout.free_during_train", "or set rollout.free_during_train=kv_cache"
    require(sync_method not in ("shared", "lora"), key,
            f"kv_cache_and_weights frees the engine's own copy of the weights, but sync.method={sync_method} "
            + ("shares the trainer's (nothing to free)" if sync_method == "shared" else "pushes adapters only"),
            f"use a sync method that pushes full weights (checkpoint, nccl, ray, cuda_ipc), {fix}")
    require(spec.sync.every_n_steps == 1, key,
            f"kv_cache_and_weights needs a push before every rollout to restore the weights, but sync.every_n_steps="
            f"{spec.sync.every_n_steps}", f"set sync.every_n_steps=1, {fix}")
    require(not rollout.agent.enabled, key, "an agent calls the engine several times per rollout step, and the weights "
            "would be gone after its first call", fix.removeprefix("or ").capitalize())
    require(rollout.mode == "sync", key, "kv_cache_and_weights frees the engine's weights while the trainer steps, but "
            "rollout.mode=async samples then", f"set rollout.mode=sync, {fix}")
    require(rollout.engine == "hf", key, "applies to the hf engine", "use rollout.engine=hf, or rollout.free_during_train=none")
    served = caps.single_process and (spec.hardware.rollout == "separate" or sync_method == "cuda_ipc")
    require(not served, key, f"backend {caps.name} samples through a rollout server here (`rlspec serve`), which "
            "keeps its weights to answer requests between pushes", f"use backend=deepspeed or fsdp colocated, {fix}")


def _check_files(spec: Spec) -> None:
    if spec.model.path is not None:
        path = Path(spec.model.path)
        require(path.is_dir(), "model.path", f"{spec.model.path} is not a directory",
                "point model.path at a local directory holding config.json and the weights, or unset it to use model.preset")
        require((path / "config.json").is_file(), "model.path", f"{spec.model.path} has no config.json",
                "save the model there with save_pretrained")
    data = spec.rollout.task.data_path
    if data is not None:  # what it holds is checked by `rlspec.tasks.check_task`
        require(Path(data).exists(), "rollout.task.data_path", f"{data} does not exist",
                "give the path (relative to the current directory) of a local .jsonl or .parquet file, or of a "
                "directory saved by datasets")
