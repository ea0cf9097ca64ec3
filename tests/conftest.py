"""Shared test fixtures: quiet, deterministic CPU runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests cleanly when no CUDA device is visible."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def repo() -> Path:
    return REPO


def rlspec_cmd(*args: str) -> list[str]:
    """The real entry point, in a subprocess."""
    return [sys.executable, "-m", "rlspec.cli", *args]
