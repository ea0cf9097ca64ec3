"""`rlspec plan` validates a spec without importing torch or transformers (they cost ~3 s of a 2-core machine's
start-up), and the backends' caps it reads instead of their modules are the caps the backends run with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rlspec.core.backend import CAPS_ENTRY_POINT_GROUP, _entry_points, backend_class, backend_names

REPO = Path(__file__).resolve().parents[2]

# Plans every shipped example and one bad spec in one fresh interpreter, then reports what got imported.
PROBE = """
import contextlib, io, json, sys
from rlspec.cli import main
codes = {}
for spec in sys.argv[1:]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        codes[spec] = main(["plan", spec])
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    codes["bad override"] = main(["plan", "examples/tiny.yaml", "algorithm.lr=fast"])
    codes["unknown key"] = main(["plan", "examples/tiny.yaml", "algorithm.no_such_key=1"])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "deepspeed", "ray"})
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def test_plan_imports_neither_torch_nor_transformers():
    examples = sorted(str(p.relative_to(REPO)) for p in (REPO / "examples").glob("*.yaml"))
    out = subprocess.run([sys.executable, "-c", PROBE, *examples], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["codes"] == {**{spec: 0 for spec in examples}, "bad override": 2, "unknown key": 2}, report
    assert report["heavy"] == [], f"`rlspec plan` imported {report['heavy']}: keep their imports lazy on the plan path"


def test_registered_caps_are_the_backends_own():
    declared = _entry_points(CAPS_ENTRY_POINT_GROUP)
    assert sorted(declared) == backend_names()
    for name, entry in declared.items():
        assert entry.load() is backend_class(name).caps, name  # type: ignore[attr-defined]
