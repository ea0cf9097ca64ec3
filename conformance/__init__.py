"""The conformance suite: proof that a backend computes the same GRPO step as the single-process reference.

Importable by a third-party backend package::

    from rlspec.conformance import run_suite
    run_suite({"mine": MyBackend}).raise_for_failures()

See `conformance/README.md` for what is checked and why each tolerance is what it is.
"""

from .cases import CASES, NUM_STEPS, Case, case_by_name, case_spec
from .fixture import Fixture, build_fixture
from .reference import CaseRun, StepRecord, SuiteError, run_backend, run_reference
from .report import JSON_KEYS, Check, Report, Skipped
from .suite import check_case, check_sync, measure_sync, resolve_backends, run_suite, split_label
from .tolerances import TOLERANCES, Tolerance

__all__ = [
    "CASES", "JSON_KEYS", "NUM_STEPS", "TOLERANCES", "Case", "CaseRun", "Check", "Fixture", "Report", "Skipped",
    "StepRecord", "SuiteError", "Tolerance", "build_fixture", "case_by_name", "case_spec", "check_case", "check_sync",
    "measure_sync", "resolve_backends", "run_backend", "run_reference", "run_suite", "split_label",
]
