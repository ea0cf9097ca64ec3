"""The conformance suite on every registered backend, one test per (backend, case), plus the sync checks; backend
variants (spec overrides, `NAME@KEY=VALUE`) with `-m slow`."""

from __future__ import annotations

import pytest

from rlspec.core.backend import all_caps
from rlspec.conformance import CASES, Report, run_suite, split_label
from rlspec.spec import SpecError

CAPS = all_caps()
VARIANTS = ("deepspeed@hardware.deepspeed.zero_stage=2", "deepspeed@hardware.deepspeed.zero_stage=3")
"""Registered backends run with spec overrides: the whole suite each, so with -m slow (plain `deepspeed` is the stage
the plan picks for the tiny model, ZeRO-1; in CI 2-rank ZeRO-3, ZeRO-2 and ZeRO-1 tests in tests/backends/deepspeed
check the same step against the single-process trainer)."""


def _marks(label: str) -> list:
    # Multi-rank backends spawn processes / a Ray cluster.
    name, overrides = split_label(label)
    marks = [pytest.mark.distributed] if CAPS[name].max_trainer_ranks >= 2 else []
    return marks + ([pytest.mark.slow] if overrides else [])


def _share_ray(label: str, request) -> None:
    """A multi-rank backend's cases join the module's Ray session: a cluster started per case cost ~10 s of each."""
    if CAPS[split_label(label)[0]].max_trainer_ranks >= 2:
        request.getfixturevalue("ray_session")


def _skip_if_not_implemented(report: Report) -> None:
    """Skip only while a backend's `setup` still says it is not implemented (detected by trying)."""
    for check in report.failures():
        if check.value is None and "not implemented" in check.detail.lower():
            pytest.skip(f"{check.backend}: {check.detail}")


def _skip_if_nothing_ran(report: Report) -> None:
    if not report.checks and report.skipped:
        pytest.skip("; ".join(s.reason for s in report.skipped))


LABELS = [*sorted(CAPS), *(v for v in VARIANTS if split_label(v)[0] in CAPS)]


@pytest.mark.parametrize("name,case", [pytest.param(n, c.name, marks=_marks(n), id=f"{n}-{c.name}")
                                       for n in LABELS for c in CASES])
def test_case_matches_reference(name: str, case: str, request) -> None:
    _share_ray(name, request)
    report = run_suite([name], cases=[case], sync=False)
    _skip_if_not_implemented(report)
    _skip_if_nothing_ran(report)
    assert report.passed, report.failure_message()


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in LABELS])
def test_weight_sync_matches_trainer(name: str, request) -> None:
    _share_ray(name, request)
    report = run_suite([name], cases=[], sync=True)
    _skip_if_not_implemented(report)
    _skip_if_nothing_ran(report)
    assert report.passed, report.failure_message()
    assert {c.transport for c in report.checks} | {s.transport for s in report.skipped} == set(CAPS[split_label(name)[0]].sync_methods)


def test_a_variants_overrides_reach_the_backend_only():
    """The overrides change the backend's spec, never the reference's: a variant that changes the math fails, with
    its label in the report; a bad override is refused before anything runs."""
    report = run_suite(["standalone@algorithm.lr=0.05"], cases=["token_mean_sgd"], sync=False)
    assert not report.passed
    assert {c.backend for c in report.checks} == {"standalone@algorithm.lr=0.05"}
    assert any(c.metric == "weights/max_abs_diff" and not c.passed for c in report.checks)
    with pytest.raises(SpecError, match="hardware.deepspeed.zero_stage"):
        run_suite(["standalone@hardware.deepspeed.zero_stage=4"], cases=["token_mean_sgd"], sync=False)
