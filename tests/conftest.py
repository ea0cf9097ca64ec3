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


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session for a module's multi-rank tests (a run in this process joins it instead of starting
    and stopping a cluster of its own: `rlspec.cluster.ray_utils.start_ray`)."""
    pytest.importorskip("ray")
    from rlspec.cluster.ray_utils import start_ray, stop_ray

    started = start_ray(None)
    yield
    if started:
        stop_ray()


def rlspec_cmd(*args: str) -> list[str]:
    """The real entry point, in a subprocess."""
    return [sys.executable, "-m", "rlspec.cli", *args]


def wait_for_metric_rows(proc, metrics: Path, rows: int, timeout_s: float = 300, poll_s: float = 0.5) -> None:
    """Block until the run `proc` (a `subprocess.Popen` with piped stderr) has written `rows` lines of `metrics`;
    fail with its stderr if it exits first, or after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and metrics.read_text().count("\n") >= rows):
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, f"the run did not write {rows} metrics rows within {timeout_s} s"
        time.sleep(poll_s)


def interrupt_after_rows(proc, metrics: Path, rows: int, interrupt, timeout_s: float = 120) -> tuple[str, float]:
    """Once the run `proc` has written `rows` metrics rows, call `interrupt()` (send a signal, kill a rank) and wait
    for the run to exit: returns (its stderr, seconds from the interruption to the exit). The run never outlives
    the test."""
    import time

    try:
        wait_for_metric_rows(proc, metrics, rows, poll_s=0.05)
        interrupt()
        sent = time.monotonic()
        _, err = proc.communicate(timeout=timeout_s)
        return err, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
