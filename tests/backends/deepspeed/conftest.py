"""The deepspeed backend tests need deepspeed and ray (the Ray session fixture is in tests/backends)."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("ray")
