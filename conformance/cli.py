"""`rlspec conformance [--backends a,b] [--json FILE] [--dump DIR]`: exit 0 only if every check passes."""

from __future__ import annotations

import sys

from ..spec import SpecError
from .suite import run_suite


def main(backends: str | None, json_path: str | None, dump: str | None) -> int:
    if backends is not None and not [n for n in backends.split(",") if n.strip()]:
        raise SpecError("--backends", "no backend named", "give comma-separated names, e.g. --backends standalone")
    report = run_suite(backends, dump=dump, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(report.text())
    if json_path:
        report.write_json(json_path)
    return 0 if report.passed else 1
