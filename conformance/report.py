"""Check records and the report: the JSON contract of `rlspec conformance --json` and the failure text."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .tolerances import Tolerance

JSON_KEYS = ("backend", "transport", "case", "metric", "value", "tolerance", "passed")


@dataclass
class Check:
    """One measured difference against the reference (or one error that stopped measuring)."""

    backend: str
    transport: str | None
    case: str
    metric: str
    value: float | None
    """The measured |backend - reference| (None when an error prevented the measurement)."""
    tolerance: float | None
    passed: bool
    detail: str = ""
    """The numbers behind `value`, or the error; shown in the text report, not part of the JSON."""

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in JSON_KEYS}
        if out["value"] is not None and not math.isfinite(out["value"]):
            out["value"] = None  # JSON has no NaN; `passed` is false and the text report says why
        return out

    def line(self) -> str:
        status = "ok  " if self.passed else "FAIL"
        where = f"{self.backend}" + (f" [{self.transport}]" if self.transport else "")
        if self.value is None:
            return f"{status} {where} {self.case} {self.metric}: {self.detail}"
        op = "<=" if self.passed else ">"
        return f"{status} {where} {self.case} {self.metric}: {self.value:.3e} {op} tolerance {self.tolerance:.3e} ({self.detail})"


def compare(backend: str, case: str, metric: str, measured: float, reference: float, tol: Tolerance,
            magnitude: float | None = None, transport: str | None = None) -> Check:
    """|measured - reference| against `tol` (scaled by |reference|, or by `magnitude` when given)."""
    value = abs(measured - reference)
    bound = tol.bound(abs(reference) if magnitude is None else magnitude)
    passed = math.isfinite(value) and value <= bound
    detail = f"backend {measured:.8g} vs reference {reference:.8g}; atol {tol.atol:g} + rtol {tol.rtol:g} x |ref|"
    return Check(backend, transport, case, metric, value, bound, passed, detail)


def error_check(backend: str, case: str, metric: str, err: BaseException, transport: str | None = None) -> Check:
    """A check that could not be measured because the backend (or transport) raised."""
    import traceback

    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<")]
    where = f" (raised at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return Check(backend, transport, case, metric, None, None, False, f"{type(err).__name__}: {err}{where}")


@dataclass
class Skipped:
    backend: str
    transport: str | None
    case: str
    reason: str

    def to_json(self) -> dict:
        return {"backend": self.backend, "transport": self.transport, "case": self.case, "reason": self.reason}


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        """True only if there is at least one check and every check passed."""
        return bool(self.checks) and all(c.passed for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def failure_message(self) -> str:
        """The failing checks, one per line, with the numbers (what pytest shows)."""
        failures = self.failures()
        if not failures:
            return "no conformance check failed" if self.checks else "no conformance check ran"
        return f"{len(failures)} of {len(self.checks)} conformance checks failed:\n" + \
            "\n".join(c.line() for c in failures)

    def raise_for_failures(self) -> None:
        """For third-party test suites: `AssertionError` listing every failing check."""
        if not self.passed:
            raise AssertionError(self.failure_message())

    def text(self) -> str:
        lines = [c.line() for c in self.checks]
        lines += [f"skip {s.backend}" + (f" [{s.transport}]" if s.transport else "") + f" {s.case}: {s.reason}"
                  for s in self.skipped]
        verdict = "PASSED" if self.passed else "FAILED"
        lines.append(f"conformance {verdict}: {len(self.checks) - len(self.failures())}/{len(self.checks)} checks "
                     f"passed, {len(self.skipped)} skipped, {self.wall_s:.1f} s")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"passed": self.passed, "wall_s": round(self.wall_s, 3), "checks": [c.to_json() for c in self.checks],
                "skipped": [s.to_json() for s in self.skipped]}

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def extend(self, other: "Report") -> None:
        self.checks += other.checks
        self.skipped += other.skipped
