"""The compiler: batch arithmetic, sync resolution, example specs, and the golden plan of tiny.yaml."""

from __future__ import annotations

import copy
import json
import subprocess

import pytest

from rlspec.core.backend import all_caps
from rlspec.run import build_plan
from rlspec.spec import BackendCaps, Spec, SpecError, compile_plan, load_spec
from tests.conftest import REPO, rlspec_cmd

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
GOLDEN = REPO / "tests" / "golden" / "tiny_plan.json"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_compiles(path, monkeypatch):
    monkeypatch.chdir(REPO)
    plan, _ = build_plan(str(path))
    assert json.loads(plan.to_json())["spec"]["backend"] == plan.backend


@pytest.mark.parametrize("backend", sorted(all_caps()))
def test_tiny_example_compiles_for_every_backend(backend, monkeypatch):
    monkeypatch.chdir(REPO)
    plan, _ = build_plan("examples/tiny.yaml", backend=backend)
    assert plan.backend == backend


def test_golden_plan_of_tiny_example(monkeypatch):
    """A change to a default shows up here, in review. Regenerate with: rlspec plan examples/tiny.yaml."""
    monkeypatch.chdir(REPO)
    plan, _ = build_plan("examples/tiny.yaml")
    assert json.loads(plan.to_json()) == json.loads(GOLDEN.read_text())


def test_plan_cli_prints_json_for_deepspeed():
    proc = subprocess.run(rlspec_cmd("plan", "examples/tiny.yaml", "--backend", "deepspeed"),
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["backend"] == "deepspeed"
    assert plan["sync_method"] == "ray"  # colocated on CPU, multi-process
    assert set(plan["spec"]) == {"algorithm", "model", "rollout", "sync", "hardware", "checkpoint", "logging", "eval",
                                 "backend"}


CAPS = {
    "single": BackendCaps("single", sync_methods=("shared", "checkpoint"), single_process=True, max_trainer_ranks=1,
                          supports_lora=True),
    "multi": BackendCaps("multi", placements=("colocated", "separate"), sync_methods=("ray", "nccl", "cuda_ipc", "checkpoint"),
                         model_kinds=("causal_lm", "vla")),
}


def spec_with(**sections) -> Spec:
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.structured(Spec), sections)
    return OmegaConf.to_object(cfg)


def test_batch_arithmetic():
    spec = spec_with(backend="multi", algorithm={"group_size": 4, "micro_batch_size": 3, "updates_per_batch": 2},
                     rollout={"prompts_per_step": 6}, hardware={"num_trainer_ranks": 2})
    batch = compile_plan(spec, CAPS).batch
    assert batch.sequences_per_step == 24
    assert batch.sequences_per_update == 12
    assert batch.sequences_per_update_per_rank == 6
    assert batch.grad_accum_steps == 2


@pytest.mark.parametrize("backend, rollout, device, want", [
    ("single", "colocated", "cpu", "shared"),
    ("multi", "colocated", "cpu", "ray"),
    ("multi", "colocated", "cuda", "cuda_ipc"),
    ("multi", "separate", "cuda", "nccl"),
    ("multi", "separate", "cpu", "nccl"),
])
def test_auto_sync_resolution(backend, rollout, device, want):
    spec = spec_with(backend=backend, hardware={"rollout": rollout, "device": device})
    assert compile_plan(spec, CAPS).sync_method == want


def test_auto_sync_gives_a_single_process_async_run_an_engine_of_its_own():
    """Async generation overlaps the update, so `shared` weights would be read half-updated: auto picks a copy."""
    spec = spec_with(backend="single", rollout={"mode": "async", "max_staleness": 1})
    assert compile_plan(spec, CAPS).sync_method == "checkpoint"
    spec = spec_with(backend="single", rollout={"mode": "async", "max_staleness": 0})
    assert compile_plan(spec, CAPS).sync_method == "shared"  # no overlap: the synchronous run's numbers


def test_gpu_placement_separate():
    spec = spec_with(backend="multi", hardware={"rollout": "separate", "device": "cuda", "num_trainer_ranks": 2},
                     rollout={"prompts_per_step": 8})
    placement = compile_plan(spec, CAPS).placement
    assert placement.trainer_devices == ("cuda:0", "cuda:1")
    assert placement.engine_devices == ("cuda:2",)
    assert placement.num_gpus == 3


def test_errors_name_supporting_backends():
    with pytest.raises(SpecError, match="model.kind.*backends that support it: multi"):
        compile_plan(spec_with(backend="single", model={"kind": "vla"}), CAPS)
    with pytest.raises(SpecError, match="sync.method=cuda_ipc needs hardware.rollout=colocated"):
        compile_plan(spec_with(backend="multi", sync={"method": "cuda_ipc"}, hardware={"rollout": "separate", "device": "cuda"}), CAPS)


def test_bridge_settings_are_checked():
    with pytest.raises(SpecError, match="sync.method=nccl with hardware.rollout=colocated puts both ends"):
        compile_plan(spec_with(backend="multi", sync={"method": "nccl"}, hardware={"device": "cuda"}), CAPS)
    with pytest.raises(SpecError, match="rollout.server_url: joining a rollout server needs hardware.rollout=separate"):
        compile_plan(spec_with(backend="multi", rollout={"server_url": "http://127.0.0.1:8000"}), CAPS)
    with pytest.raises(SpecError, match="rollout.server_url.*not an http"):
        spec_with(backend="multi", rollout={"server_url": "127.0.0.1:8000"})
    with pytest.raises(SpecError, match="rollout.server_start_timeout_s"):
        spec_with(backend="multi", rollout={"server_start_timeout_s": 0})
    with pytest.raises(SpecError, match="rollout.server_reconnect_s"):
        spec_with(backend="multi", rollout={"server_reconnect_s": -1})


@pytest.mark.parametrize("stage", [1, 2])
def test_parameter_offload_needs_zero3_on_deepspeed_only(monkeypatch, stage):
    """ZeRO-1 and ZeRO-2 cannot offload parameters; the section is the deepspeed backend's, so fsdp's plan is not
    refused."""
    monkeypatch.chdir(REPO)
    offload = ["hardware.device=cuda", "hardware.offload_params=true", f"hardware.deepspeed.zero_stage={stage}"]
    with pytest.raises(SpecError, match=f"hardware.offload_params=true with hardware.deepspeed.zero_stage={stage}"):
        build_plan("examples/tiny.yaml", offload, backend="deepspeed")
    assert build_plan("examples/tiny.yaml", offload, backend="fsdp")[0].spec.hardware.offload_params
    assert build_plan("examples/tiny.yaml", offload[:2], backend="deepspeed")[0].sharding.zero_stage == 3


@pytest.mark.parametrize("backend, overrides, want", [
    ("deepspeed", [], (1, None, "ZeRO-1: 16-bit weights and gradients 0.00 GB")),
    ("deepspeed", ["model=qwen2_7b_shape", "hardware.device=cuda"], (3, None, "28.37 GB > hardware.deepspeed.zero1_max_gb")),
    ("deepspeed", ["model=qwen2_0p5b_shape", "hardware.device=cuda", "hardware.deepspeed.zero1_max_gb=1"],
     (3, None, "1.84 GB > hardware.deepspeed.zero1_max_gb 1")),
    ("deepspeed", ["hardware.device=cuda", "hardware.offload_params=true"], (3, None, "offload_params needs it")),
    ("deepspeed", ["hardware.deepspeed.zero_stage=2"], (2, None, "as set")),
    ("fsdp", [], (None, False, "one trainer rank")),
    ("fsdp", ["hardware.num_trainer_ranks=2"], (None, False, "kept gathered through the update")),
    ("fsdp", ["hardware.num_trainer_ranks=2", "model=qwen2_7b_shape", "hardware.device=cuda",
              "hardware.fsdp.gathered_max_gb=4"], (None, True, "14.19 GB > hardware.fsdp.gathered_max_gb")),
    ("fsdp", ["hardware.num_trainer_ranks=2", "hardware.fsdp.reshard_after_forward=false"], (None, False, "as set")),
    ("standalone", [], (None, None, "one process"))])
def test_plan_states_the_sharding_it_picked(monkeypatch, backend, overrides, want):
    """ZeRO-1 where every rank can hold the 16-bit weights and gradients (`hardware.deepspeed.zero1_max_gb`), else
    ZeRO-3; the parameter count from the preset (exact: tests/test_models.py)."""
    monkeypatch.chdir(REPO)
    sharding = build_plan("examples/tiny.yaml", overrides, backend=backend)[0].sharding
    assert (sharding.zero_stage, sharding.reshard_after_forward) == want[:2]
    assert want[2] in sharding.why
    assert sharding.num_parameters == (7_615_616_512 if "model=qwen2_7b_shape" in overrides else
                                       494_032_768 if "model=qwen2_0p5b_shape" in overrides else 90_944)


def test_plan_is_frozen():
    plan = compile_plan(spec_with(backend="single"), CAPS)
    with pytest.raises(AttributeError):
        plan.spec.algorithm.lr = 1.0
    with pytest.raises(AttributeError):
        plan.sync_method = "ray"


def test_presets_and_overrides_compose(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("defaults:\n  - model: tiny_qwen2\n  - _self_\nalgorithm:\n  lr: 0.5\n")
    spec = load_spec(path, ["algorithm=dr_grpo", "model=qwen2_0p5b_shape", "algorithm.group_size=3"])
    assert (spec.algorithm.loss_agg, spec.algorithm.adv_norm, spec.algorithm.lr) == ("seq-mean-token-sum-norm", "none", 0.5)
    assert spec.model.preset == "qwen2_0p5b_shape" and spec.algorithm.group_size == 3


def test_reward_kwargs_reach_the_reward_function(monkeypatch):
    monkeypatch.chdir(REPO)
    _, task = build_plan("examples/tiny.yaml", ["rollout.task.reward_kwargs.target_len=2"])
    prompt = task.sample(0, 1)[0]
    letter = prompt.meta["letter"]
    assert task.reward(letter * 2 + "zzzzzz", prompt) == 1.0  # with the default target_len=8 this would be 0.25


def test_command_line_preset_overrides_the_file(tmp_path):
    """`hardware=gpu1` must win over `hardware.device: cpu` written in the file, or a GPU run silently runs on CPU."""
    path = tmp_path / "x.yaml"
    path.write_text("hardware:\n  device: cpu\n  num_threads: 2\nalgorithm:\n  lr: 0.5\n")
    spec = load_spec(path, ["hardware=gpu1", "algorithm=dapo"])
    assert spec.hardware.device == "cuda" and spec.hardware.num_threads == 2
    assert spec.algorithm.clip_eps_high == 0.28 and spec.algorithm.lr == 0.5
    assert load_spec(path, ["hardware=gpu1", "hardware.device=cpu"]).hardware.device == "cpu"  # a key override wins last


@pytest.mark.parametrize("hardware, ranks, engines, sync", [
    ("gpu2_colocated", 2, 2, "cuda_ipc"), ("gpu4_colocated", 4, 4, "cuda_ipc"), ("gpu4_split", 2, 2, "nccl"),
    ("gpu8_colocated", 8, 8, "cuda_ipc"), ("gpu8_split", 4, 4, "nccl"),
])
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_the_multi_gpu_presets_compile_to_the_placement_they_state(hardware, ranks, engines, sync, backend, monkeypatch):
    monkeypatch.chdir(REPO)
    plan, _ = build_plan("examples/tiny.yaml", [f"hardware={hardware}", "model=qwen2_7b_shape",
                                               "rollout.prompts_per_step=64", "algorithm.micro_batch_size=4"],
                         backend=backend)
    assert len(plan.placement.trainer_devices) == ranks and plan.sync_method == sync
    engine_devices = set(plan.placement.engine_devices)
    assert len(engine_devices) == engines
    assert (engine_devices == set(plan.placement.trainer_devices)) == (sync == "cuda_ipc")


def test_resume_allow_list_names_real_fields_and_splits_changes():
    """Every field the resume rules allow to change exists (a renamed field would silently become refused), and
    a change is sorted into allowed and refused by that list alone."""
    import dataclasses

    from rlspec.spec import RESUMABLE_CHANGES, Spec, resume_changes
    from rlspec.spec.resume import flatten

    fields = set(flatten(dataclasses.asdict(Spec())))
    assert set(RESUMABLE_CHANGES) <= fields, set(RESUMABLE_CHANGES) - fields
    started = dataclasses.asdict(Spec())
    now = copy.deepcopy(started)
    now["algorithm"]["steps"] += 5
    now["rollout"]["decode_slots"] += 1
    now["algorithm"]["group_size"] += 1
    now["model"]["eos_hazard"] = 0.01
    allowed, refused = resume_changes(started, now)
    assert allowed == ["algorithm.steps", "rollout.decode_slots"]
    assert refused == ["algorithm.group_size", "model.eos_hazard"]


def test_the_plan_dispatches_prompts_by_work_to_several_engines_and_says_so(monkeypatch):
    monkeypatch.chdir(REPO)

    def plan(path, *overrides):
        return compile_plan(load_spec(path, ["hardware.num_trainer_ranks=2", "algorithm.micro_batch_size=4",
                                             *overrides], "fsdp"), all_caps()).dispatch

    def dispatch(path, *overrides):
        return plan(path, *overrides).method

    two = "hardware.num_rollout_engines=2"
    assert dispatch("examples/tiny.yaml", two) == "split"  # 4 x 8 samples an engine fit its 256 slots
    assert dispatch("examples/tiny.yaml", two, "rollout.decode_slots=16") == "queue"  # 32 do not fit 16
    assert dispatch("examples/tiny.yaml", two, "rollout.dispatch=queue") == "queue"
    # a chunk fills an engine's slots, but holds no more than an engine's share: every engine gets work
    assert plan("examples/tiny.yaml", two, "rollout.decode_slots=16").chunk_prompts == 2  # 16 slots / 8 a group
    assert plan("examples/tiny.yaml", two, "rollout.dispatch=queue").chunk_prompts == 4  # 8 prompts / 2 engines
    assert plan("examples/tiny.yaml", two, "rollout.dispatch=queue", "rollout.prompts_per_step=3").chunk_prompts == 2
    assert plan("examples/tiny.yaml", two, "rollout.dispatch_chunk_prompts=8").chunk_prompts == 8  # as set
    assert dispatch("examples/tiny.yaml") == "split"  # one engine
    assert dispatch("examples/vla_babyai.yaml", two) == "split"  # each engine keeps its groups' environments
    with pytest.raises(SpecError, match="rollout.dispatch"):
        dispatch("examples/vla_babyai.yaml", two, "rollout.dispatch=queue")
