"""Running the project's Triton kernels on CPU under Triton's interpreter (`TRITON_INTERPRET=1`, in a fresh
process: the interpreter is chosen when the kernels are defined)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def allow_scalar_loop_bounds() -> None:
    """The interpreter (Triton 3.5) holds a scalar (a loaded value, a kernel argument in arithmetic) as a
    1-element array, which a loop bound cannot take: give its tensors `__index__` (Triton 3.6 passes a patch scope
    as well, and its own `int(data)` fails under NumPy 2.4 for a 1-element array of one dimension)."""
    import triton.runtime.interpreter as interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, *scope):
        patch(tensor, *scope)
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    interpreter._patch_lang_tensor = patched


def run_interpreted(module: str) -> None:
    """Run `module`'s `_interpreted()` in a fresh process under the interpreter; fails with its stderr's tail."""
    pytest.importorskip("triton")
    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-c", f"import {module} as t; t._interpreted()"], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
