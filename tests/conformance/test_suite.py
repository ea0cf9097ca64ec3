"""The conformance suite on every registered backend, one test per (backend, case), plus the sync checks."""

from __future__ import annotations

import pytest

from rlspec.core.backend import all_caps
from rlspec.conformance import CASES, Report, run_suite

CAPS = all_caps()


def _marks(name: str) -> list:
    # Multi-rank backends spawn processes / a Ray cluster.
    return [pytest.mark.distributed] if CAPS[name].max_trainer_ranks >= 2 else []


def _skip_if_not_implemented(report: Report) -> None:
    """Skip only while a backend's `setup` still says it is not implemented (detected by trying)."""
    for check in report.failures():
        if check.value is None and "not implemented" in check.detail.lower():
            pytest.skip(f"{check.backend}: {check.detail}")


def _skip_if_nothing_ran(report: Report) -> None:
    if not report.checks and report.skipped:
        pytest.skip("; ".join(s.reason for s in report.skipped))


@pytest.mark.parametrize("name,case", [pytest.param(n, c.name, marks=_marks(n), id=f"{n}-{c.name}")
                                       for n in sorted(CAPS) for c in CASES])
def test_case_matches_reference(name: str, case: str) -> None:
    report = run_suite([name], cases=[case], sync=False)
    _skip_if_not_implemented(report)
    _skip_if_nothing_ran(report)
    assert report.passed, report.failure_message()


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in sorted(CAPS)])
def test_weight_sync_matches_trainer(name: str) -> None:
    report = run_suite([name], cases=[], sync=True)
    _skip_if_not_implemented(report)
    _skip_if_nothing_ran(report)
    assert report.passed, report.failure_message()
    assert {c.transport for c in report.checks} | {s.transport for s in report.skipped} == set(CAPS[name].sync_methods)
