"""The spec: schema (one dataclass per section), Hydra composition, and the compiler to a frozen RunPlan."""

from .compile import BackendCaps, BatchPlan, Placement, RunPlan, compile_plan
from .errors import SpecError
from .load import load_spec, preset_names, split_label, with_overrides
from .resume import RESUMABLE_CHANGES, resume_changes
from .schema import (AlgorithmSpec, CheckpointSpec, DeepSpeedSpec, FSDPSpec, HardwareSpec, LoggingSpec, LoraSpec,
                     MLflowSpec, ModelSpec, RolloutSpec, Spec, SyncSpec, WandbSpec)
from .sources import AgentSpec, EnvSpec, JudgeSpec, RewardSpec, TaskSpec

__all__ = [
    "AgentSpec", "AlgorithmSpec", "BackendCaps", "BatchPlan", "CheckpointSpec", "DeepSpeedSpec", "EnvSpec", "FSDPSpec", "HardwareSpec", "JudgeSpec",
    "LoggingSpec", "LoraSpec", "MLflowSpec", "ModelSpec",
    "Placement", "RESUMABLE_CHANGES", "RewardSpec", "RolloutSpec", "RunPlan", "Spec", "SpecError", "SyncSpec", "TaskSpec", "WandbSpec", "compile_plan",
    "load_spec", "preset_names", "resume_changes", "split_label", "with_overrides",
]
