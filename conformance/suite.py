"""`run_suite`: every case on every backend under test, compared with the reference; the weight-sync checks.

Backends are driven only through the `Backend` protocol, with a `RunPlan` from `compile_plan`. A
backend that can run several trainer ranks (`caps.max_trainer_ranks >= 2`) runs every case on 2 ranks.
A backend is named by a label: its name, or a variant with spec overrides, `NAME@KEY=VALUE[@KEY=VALUE...]`
(`split_label`), as `rlspec bench --backends` names its runs.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ..core.backend import backend_class, backend_names
from ..core.step import update
from ..spec import BackendCaps, compile_plan, split_label
from .cases import CASES, NUM_THREADS, Case, case_by_name, case_spec
from .fixture import Fixture, build_fixture, dump_fixture, vla_fixture
from .reference import CaseRun, run_backend, run_reference
from .report import Check, Report, Skipped, compare, error_check
from .tolerances import TOLERANCES, weights_tolerance

REFERENCE = "reference"
SYNC_CASE = "sync_after_1_update"
GPU_ONLY_TRANSPORTS = ("cuda_ipc",)
"""Transports that cannot run without CUDA devices (the CPU `nccl` path runs over gloo and is checked)."""

BackendsArg = Mapping[str, type] | Sequence[str] | str | None


def resolve_backends(backends: BackendsArg) -> dict[str, type]:
    """Label -> backend class: classes as given, or names looked up in the `rlspec.backends` registry. A label's
    overrides are checked here, so a bad one is refused (`SpecError`) before any backend runs."""
    if isinstance(backends, Mapping):
        classes = dict(backends)
    else:
        if backends is None:
            labels = backend_names()
        elif isinstance(backends, str):
            labels = [n.strip() for n in backends.split(",") if n.strip()]
        else:
            labels = list(backends)
        classes = {label: backend_class(split_label(label)[0]) for label in labels}
    for label in classes:
        name, overrides = split_label(label)
        if overrides:
            case_spec(CASES[0], name, 1, overrides=overrides)
    return classes


def num_trainer_ranks(caps: BackendCaps) -> int:
    """2 data-parallel ranks where the backend can run them (the unequal-token-count split), else 1."""
    return 2 if caps.max_trainer_ranks >= 2 else 1


def run_suite(backends: BackendsArg = None, cases: Iterable[str | Case] | None = None, sync: bool = True,
              dump: str | Path | None = None, progress: Callable[[str], None] | None = None) -> Report:
    """Run the conformance cases (default: all) and, with `sync`, the weight-sync checks on each backend.

    `backends`: a mapping label -> backend class (a third party's class needs no registration), a list
    of registered names or labels (`split_label`), a comma-separated string, or None for every registered backend.
    """
    start = time.perf_counter()
    classes = resolve_backends(backends)
    selected = [case_by_name(c) if isinstance(c, str) else c for c in cases] if cases is not None else list(CASES)
    with _torch_threads(NUM_THREADS):
        report = _run(classes, selected, sync, dump, progress or (lambda _: None))
    report.wall_s = time.perf_counter() - start
    return report


def _run(classes: dict[str, type], selected: list[Case], sync: bool, dump: str | Path | None,
         say: Callable[[str], None]) -> Report:
    fixtures = {False: build_fixture()}
    if any(c.vla for c in selected):
        fixtures[True] = vla_fixture()
    dumper = _Dumper(Path(dump)) if dump is not None else None
    if dumper:
        for vla, fixture in fixtures.items():
            dumper.fixture(fixture, {c.name: case_spec(c, REFERENCE, 1) for c in selected if c.vla == vla},
                           "fixture_vla" if vla else "fixture")
    references: dict[str, CaseRun] = {}
    report = Report()
    fixture = fixtures[False]
    for name, cls in classes.items():
        for case in selected:
            say(f"conformance: {name} {case.name}")
            report.extend(check_case(name, cls, case, fixtures[case.vla], references, dumper))
        if sync:
            say(f"conformance: {name} weight sync")
            report.extend(check_sync(name, cls, fixture))
    return report


@contextmanager
def _torch_threads(num_threads: int) -> Iterator[None]:
    """The reference and in-process backends run with the threads the cases' `hardware.num_threads` names."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def check_case(name: str, cls: type, case: Case, fixture: Fixture, references: dict[str, CaseRun] | None = None,
               dumper: "_Dumper | None" = None) -> Report:
    """One case on one backend: per-step loss, grad norm, KL and the final weights against the reference."""
    report = Report()
    if case.lora_r and not cls.caps.supports_lora:
        report.skipped.append(Skipped(name, None, case.name, "the backend does not support LoRA (caps.supports_lora)"))
        return report
    if case.vla and "vla" not in cls.caps.model_kinds:
        report.skipped.append(Skipped(name, None, case.name, "the backend does not support model.kind=vla (caps.model_kinds)"))
        return report
    backend, overrides = split_label(name)
    spec = case_spec(case, backend, num_trainer_ranks(cls.caps), overrides=overrides)
    try:
        run = run_backend(backend, cls, spec, fixture)
    except Exception as err:  # noqa: BLE001 - a backend failure is a failed check, reported with its message
        report.checks.append(error_check(name, case.name, "run", err))
        return report
    if dumper:
        dumper.run(name, case.name, run)
    references = {} if references is None else references
    if case.name not in references:  # after the backend: a backend that cannot run costs no reference
        references[case.name] = run_reference(case_spec(case, REFERENCE, 1), fixture)
        if dumper:
            dumper.run(REFERENCE, case.name, references[case.name])
    ref = references[case.name]
    report.checks += compare_runs(name, case.name, spec.algorithm.optimizer, run, ref)
    return report


def compare_runs(name: str, case: str, optimizer: str, run: CaseRun, ref: CaseRun) -> list[Check]:
    checks = []
    if len(run.steps) != len(ref.steps):
        return [Check(name, None, case, "steps", float(len(run.steps)), float(len(ref.steps)), False,
                      f"backend ran {len(run.steps)} steps, the reference {len(ref.steps)}")]
    for got, want in zip(run.steps, ref.steps):
        i = got.step
        checks.append(compare(name, case, f"loss/step{i}", got.loss, want.loss, TOLERANCES["loss"]))
        checks.append(_grad_norm_check(name, case, i, got.grad_norms, want.grad_norms))
        if want.kl is not None:
            kl = float("nan") if got.kl is None else got.kl
            checks.append(compare(name, case, f"kl/step{i}", kl, want.kl, TOLERANCES["kl"]))
    checks.append(_weights_check(name, case, run.weights, ref.weights, optimizer))
    return checks


def _grad_norm_check(name: str, case: str, step: int, got: list[float], want: list[float]) -> Check:
    metric = f"grad_norm/step{step}"
    if len(got) != len(want):
        return Check(name, None, case, metric, None, None, False,
                     f"backend made {len(got)} optimizer updates, the reference {len(want)}")
    worst = max(range(len(want)), key=lambda j: abs(got[j] - want[j]))
    return compare(name, case, metric, got[worst], want[worst], TOLERANCES["grad_norm"], max(abs(w) for w in want))


def _weights_check(name: str, case: str, got: dict, want: dict, optimizer: str) -> Check:
    tol = weights_tolerance(optimizer)
    mismatched = sorted(set(got) ^ set(want))
    if mismatched:
        return Check(name, None, case, "weights/names", float(len(mismatched)), 0.0, False,
                     f"{len(mismatched)} weight name(s) differ from the model's state dict, e.g. {mismatched[:3]}")
    worst_name, worst = "", 0.0
    for key, expected in want.items():
        actual = got[key]
        if actual.shape != expected.shape:
            return Check(name, None, case, "weights/max_abs_diff", None, tol.atol, False,
                         f"{key}: shape {tuple(actual.shape)} vs the reference's {tuple(expected.shape)}")
        diff = float((actual.float() - expected.float()).abs().max()) if expected.numel() else 0.0
        if not diff <= worst:  # NaN propagates as the worst
            worst_name, worst = key, diff
    passed = worst <= tol.atol
    detail = f"largest in {worst_name}; atol {tol.atol:g}" if worst_name else f"all identical; atol {tol.atol:g}"
    return Check(name, None, case, "weights/max_abs_diff", worst, tol.atol, passed, detail)


def check_sync(name: str, cls: type, fixture: Fixture) -> Report:
    """For each transport the backend declares: after one update and a push, engine log-probs == trainer's."""
    report = Report()
    caps: BackendCaps = cls.caps
    for transport in caps.sync_methods:
        if transport in GPU_ONLY_TRANSPORTS and not torch.cuda.is_available():
            report.skipped.append(Skipped(name, transport, SYNC_CASE, f"sync.method={transport} needs CUDA devices"))
            continue
        if transport == "lora" and not caps.supports_lora:
            report.skipped.append(Skipped(name, transport, SYNC_CASE, "sync.method=lora needs caps.supports_lora"))
            continue
        case = case_by_name("lora_adamw" if transport == "lora" else "token_mean_adamw_microbatch")
        # A single-process backend's collective crosses processes only in its separate placement (a server).
        bridged = transport == "nccl" and caps.single_process and "separate" in caps.placements
        placement = "separate" if bridged else "colocated"
        backend, overrides = split_label(name)
        spec = case_spec(case, backend, num_trainer_ranks(caps), sync_method=transport, rollout_placement=placement,
                         overrides=overrides)
        metric = "logprobs/max_abs_diff"
        try:
            after, before = measure_sync(backend, cls, spec, fixture)
        except Exception as err:  # noqa: BLE001 - a transport failure is a failed check
            report.checks.append(error_check(name, SYNC_CASE, metric, err, transport))
            continue
        tol = TOLERANCES["sync/logprobs"]
        report.checks.append(Check(name, transport, SYNC_CASE, metric, after, tol.atol, after <= tol.atol,
                                   f"engine vs trainer over completion tokens; before the push: {before:.3e}"))
    return report


def measure_sync(name: str, cls: type, spec, fixture: Fixture) -> tuple[float, float]:
    """Set up, run one update, push the weights through the plan's transport; return the max |engine - trainer|
    log-prob difference over completion tokens after and before the push.

    This is the one place that knows how a transport is built and fed; adapt it here if that changes.
    """
    from ..core.backend import weight_source_of
    from ..sync import build_transport

    plan = compile_plan(spec, {name: cls.caps})
    backend = cls()
    transport = build_transport(plan.sync_method, plan.spec.sync)
    try:
        backend.setup(plan)
        engine = backend.rollout_engine()
        weights = weight_source_of(backend)
        transport.connect(engine, weights)
        batch = fixture.train_batch(plan.spec.algorithm)
        update(plan, backend, batch)
        mask = batch.loss_mask > 0
        before = _masked_max_diff(engine.logprobs(batch), backend.logprobs(batch), mask)
        transport.push(weights, engine)
        after = _masked_max_diff(engine.logprobs(batch), backend.logprobs(batch), mask)
    finally:
        transport.close()
        backend.shutdown()
    return after, before


def _masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs()[mask].max())


class _Dumper:
    """`--dump DIR`: the fixture, and per backend (and the reference) its steps and final weights."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.headline: dict[str, str] = {}

    def fixture(self, fixture: Fixture, specs: dict, folder: str = "fixture") -> None:
        if specs:
            dump_fixture(self.root / folder, fixture, specs)

    def run(self, who: str, case: str, run: CaseRun) -> None:
        from safetensors.torch import save_file

        base = self.root / who
        (base / case).mkdir(parents=True, exist_ok=True)
        rows = [{"case": case, **s.row()} for s in run.steps]
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (base / case / "steps.jsonl").write_text(text)
        first = who not in self.headline
        with open(base / "steps.jsonl", "w" if first else "a") as f:
            f.write(text)
        # Cloned: tied weights share storage, which safetensors refuses.
        weights = {k: v.detach().contiguous().clone() for k, v in run.weights.items()}
        save_file(weights, str(base / case / "final.safetensors"))
        if first:  # DIR/<backend>/final.safetensors: the first case run
            self.headline[who] = case
            save_file(weights, str(base / "final.safetensors"))
