"""The DeepSpeed config built from a plan carries the spec's ZeRO stage and knobs (no DeepSpeed world needed)."""

from __future__ import annotations

from rlspec.backends.deepspeed.worker import ds_config
from rlspec.core.backend import all_caps
from rlspec.spec import Spec, compile_plan, load_spec
from tests.backends.ranks import TINY

KNOBS = {  # spec key under hardware.deepspeed -> (value set here, DeepSpeed's zero_optimization key)
    "overlap_comm": (True, "overlap_comm"),
    "contiguous_gradients": (False, "contiguous_gradients"),
    "reduce_bucket_numel": (12_345_678, "reduce_bucket_size"),
    "prefetch_bucket_numel": (0, "stage3_prefetch_bucket_size"),
    "param_persistence_numel": (4_321, "stage3_param_persistence_threshold"),
    "max_live_numel": (987_654_321, "stage3_max_live_parameters"),
    "module_granularity_numel": (1_234_567, "stage3_module_granularity_threshold"),
    "memory_efficient_linear": (False, "memory_efficient_linear"),
}


def _plan(*overrides: str):
    """ZeRO-3 unless `overrides` name another stage (the plan would pick ZeRO-1 for the tiny model)."""
    return compile_plan(load_spec(TINY, ["hardware.deepspeed.zero_stage=3", *overrides], "deepspeed"), all_caps())


def test_spec_knobs_reach_zero_optimization():
    plan = _plan(*(f"hardware.deepspeed.{key}={value}" for key, (value, _) in KNOBS.items()))
    for train in (True, False):  # the frozen reference engine is configured the same way
        zero = ds_config(plan, train=train)["zero_optimization"]
        assert {ds_key: zero[ds_key] for _, ds_key in KNOBS.values()} == {ds_key: v for v, ds_key in KNOBS.values()}
        assert zero["stage"] == 3


def test_defaults_come_from_the_schema():
    zero = ds_config(_plan())["zero_optimization"]
    defaults = Spec().hardware.deepspeed
    resolved = ("memory_efficient_linear", "param_persistence_numel")  # null in the schema, resolved from the plan
    fixed = {key: value for key, value in KNOBS.items() if key not in resolved}
    assert {ds_key: zero[ds_key] for _, ds_key in fixed.values()} == {
        ds_key: getattr(defaults, key) for key, (_, ds_key) in fixed.items()}
    assert defaults.memory_efficient_linear is None and defaults.param_persistence_numel is None


def test_memory_efficient_linear_follows_compiled_layers_unless_set():
    """null: ZeRO-3's linear with eager layers, torch's with compiled ones; an explicit value always wins."""
    def chosen(*overrides: str) -> bool:
        return ds_config(_plan(*overrides))["zero_optimization"]["memory_efficient_linear"]

    assert chosen("model.compile_layers=false") is True
    assert chosen("model.compile_layers=true") is False
    assert chosen("model.compile_layers=true", "hardware.deepspeed.memory_efficient_linear=true") is True
    assert chosen("model.compile_layers=false", "hardware.deepspeed.memory_efficient_linear=false") is False


def test_param_persistence_keeps_every_parameter_whole_on_one_rank_unless_set():
    """null: every parameter persistent with one rank and no parameter offload (nothing to partition), DeepSpeed's
    1e5 otherwise; an explicit value always wins."""
    def chosen(*overrides: str) -> int:
        return ds_config(_plan(*overrides))["zero_optimization"]["stage3_param_persistence_threshold"]

    every = chosen()
    assert every >= 10 ** 15
    assert chosen("hardware.device=cuda", "hardware.offload_params=true") == 100_000
    assert chosen("hardware.num_trainer_ranks=2") == 100_000
    assert chosen("hardware.deepspeed.param_persistence_numel=7") == 7


SHARED = ("overlap_comm", "contiguous_gradients", "reduce_bucket_numel")
"""The knobs ZeRO-2 reads too; the rest of `KNOBS` are ZeRO-3's."""


def test_zero2_keeps_the_shared_keys_and_drops_zero3s():
    """Stage 2: the shared knobs and every numerics key written as under stage 3 (clipping, bf16 with fp32 gradient
    accumulation, optimizer offload); no `stage3_*` key, no parameter offload, no ZeRO-3 linear."""
    overrides = [f"hardware.deepspeed.{key}={value}" for key, (value, _) in KNOBS.items()]
    common = ["model.dtype=bfloat16", "algorithm.max_grad_norm=0.25", "hardware.device=cuda",
              "hardware.offload_optimizer=true", *overrides]
    three = ds_config(_plan(*common))
    two = ds_config(_plan(*common, "hardware.deepspeed.zero_stage=2"))
    zero = two["zero_optimization"]
    assert zero["stage"] == 2 and three["zero_optimization"]["stage"] == 3
    assert {KNOBS[key][1]: zero[KNOBS[key][1]] for key in SHARED} == {KNOBS[key][1]: KNOBS[key][0] for key in SHARED}
    assert not [key for key in zero if key.startswith("stage3_")]
    assert "offload_param" not in zero and "memory_efficient_linear" not in zero
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True} == three["zero_optimization"]["offload_optimizer"]
    assert two["gradient_clipping"] == 0.25
    assert two["bf16"] == {"enabled": True} and two["data_types"] == {"grad_accum_dtype": "fp32"}
    # outside zero_optimization the two stages' configs are the same
    assert {k: v for k, v in two.items() if k != "zero_optimization"} == {k: v for k, v in three.items() if k != "zero_optimization"}
    shared = {key for key in zero if key not in ("stage", "allgather_partitions", "allgather_bucket_size")}
    assert {key: zero[key] for key in shared} == {key: three["zero_optimization"][key] for key in shared}


def test_zero1_accumulates_bf16_gradients_as_the_backward_makes_them():
    """Stage 1 writes ZeRO-2's keys (no `stage3_*`, no parameter offload) and, in bf16, asks DeepSpeed's
    BF16_Optimizer to add each gradient into its fp32 accumulator from a hook (`immediate_grad_update`); no other
    stage's config carries that key."""
    common = ["model.dtype=bfloat16", "algorithm.max_grad_norm=0.25", "hardware.device=cuda"]
    one, two = (ds_config(_plan(*common, f"hardware.deepspeed.zero_stage={stage}")) for stage in (1, 2))
    three = ds_config(_plan(*common))
    assert one["zero_optimization"]["stage"] == 1
    assert {k: v for k, v in one["zero_optimization"].items() if k != "stage"} == \
        {k: v for k, v in two["zero_optimization"].items() if k != "stage"}
    assert one["bf16"] == {"enabled": True, "immediate_grad_update": True}
    assert two["bf16"] == three["bf16"] == {"enabled": True}
    assert one["data_types"] == {"grad_accum_dtype": "fp32"} and one["gradient_clipping"] == 0.25
