"""`rlspec eval SPEC --checkpoint DIR | --checkpoints OUT | --model DIR`: the spec's eval set scored on a checkpoint
(of any backend: every one writes the HF model), every checkpoint of a run, or any local HF model, with the spec's
engine (`rollout`) on the spec's device. Prints the table; writes OUT/eval.json and each one's samples beside it.

The engine is the spec's model (its preset or `model.path`) with the checkpoint's weights copied in, sampled as a
run's eval samples (`rlspec.evaluation.runner`): a run's eval of step N and this command on its step_N agree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

from ..spec import SpecError
from .data import build_eval_set, check_eval_data


def targets(checkpoints: Sequence[str], run: str | None, model: str | None) -> list[tuple[str, Path | None]]:
    """(label, checkpoint directory or None for the spec's own model) of each thing to evaluate."""
    from ..runtime.checkpoints import STATE_FILE, Checkpoints

    chosen = [bool(checkpoints), run is not None, model is not None]
    if sum(chosen) != 1:
        raise SpecError("--checkpoint", "name one kind of thing to evaluate", "give --checkpoint DIR (repeatable), "
                        "--checkpoints OUT (every checkpoint of the run in OUT) or --model DIR (a local HF model)")
    if model is not None:
        return [(Path(model).name or "model", None)]
    found: list[Path] = []
    if run is not None:
        root = Path(run) / "checkpoints" if (Path(run) / "checkpoints").is_dir() else Path(run)
        found = Checkpoints(root, 0, True).completed()
        if not found:
            raise SpecError("--checkpoints", f"{run} holds no completed checkpoint (checkpoints/step_*/{STATE_FILE})",
                            "give the --out directory of a run that saved checkpoints")
    for given in checkpoints:
        path = Path(given)
        if not (path / STATE_FILE).is_file() or not any(path.glob("*.safetensors")):
            raise SpecError("--checkpoint", f"{given} is not a completed checkpoint (no {STATE_FILE} or no "
                            "*.safetensors)", "give OUT/checkpoints/step_NNNNNN of a run, or --model DIR for a HF model")
        found.append(path)
    return [(f"{p.parent.parent.name}/{p.name}" if run is None and len(checkpoints) > 1 else p.name, p) for p in found]


def evaluate(spec_path: str, overrides: Sequence[str] = (), backend: str | None = None,
             checkpoints: Sequence[str] = (), run: str | None = None, model: str | None = None,
             out: str | None = None) -> Path:
    """Score each target (`targets`); return the output directory (eval.json, one samples file per target)."""
    from ..plan import build_plan, default_out_dir
    from .runner import Evaluator, table

    chosen = targets(checkpoints, run, model)
    if model is not None:
        overrides = [*overrides, f"model.path={model}"]
    plan, _ = build_plan(spec_path, overrides, backend)
    spec = plan.spec
    check_eval_data(spec, force=True)
    eval_set = build_eval_set(spec, spec.model)
    out_dir = Path(out) if out is not None else default_out_dir(spec_path, root="outputs/eval")
    if (out_dir / "eval.json").exists():
        raise SpecError("--out", f"{out_dir} already holds an eval (eval.json)", "choose a new --out directory")
    engine = _engine(plan)
    evaluator = Evaluator(eval_set, spec.rollout.max_new_tokens, out_dir)
    results = []
    for label, path in chosen:
        step = None
        if path is not None:
            step = _load(engine, path)
        metrics = evaluator.run(engine, -1 if step is None else step, label=label.replace("/", "_"))
        results.append({"target": str(path) if path is not None else model, "step": step, "metrics": metrics})
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps({"spec": spec_path, "overrides": list(overrides),
                                                    "results": results}, indent=2) + "\n")
    print(table(evaluator.history))
    print(f"rlspec: eval written to {out_dir}/eval.json", file=sys.stderr)
    return out_dir


def _engine(plan):
    """The spec's rollout engine in this process, on the spec's device (the first GPU on CUDA)."""
    import torch

    from ..models.factory import load_model, load_tokenizer
    from ..rollout.hf import HFEngine

    spec = plan.spec
    if spec.hardware.num_threads:
        torch.set_num_threads(spec.hardware.num_threads)
    device = "cuda" if plan.placement.device == "cuda" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecError("hardware.device", "is cuda but this machine has no usable CUDA device", "set hardware.device=cpu")
    model = load_model(spec.model, spec.algorithm.seed, device).to(device).eval().requires_grad_(False)
    return HFEngine(model, load_tokenizer(spec.model), spec.rollout, device, spec.algorithm.micro_batch_size)


def _load(engine, path: Path) -> int:
    """Copy the checkpoint's weights into the engine's model; the step it was saved after."""
    from ..models.factory import copy_weights, read_safetensors_dir
    from ..runtime.checkpoints import step_of

    tensors = read_safetensors_dir(path)
    missing = set(engine.model.state_dict()) - set(tensors)
    tied = {"lm_head.weight"} if getattr(engine.model.config, "tie_word_embeddings", False) else set()
    try:
        if missing - tied:
            raise KeyError(f"it lacks {sorted(missing - tied)[:3]}")
        copy_weights(engine.model, tensors.items())
    except KeyError as err:
        raise SpecError("--checkpoint", f"{path} holds weights of another model than the spec's ({err})",
                        "evaluate it with the spec that trained it (its model preset or model.path)") from None
    return step_of(path)
