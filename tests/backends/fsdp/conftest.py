"""The fsdp backend tests need ray (the Ray session fixture is in tests/backends)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")
