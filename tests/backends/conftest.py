"""Shared fixtures for the Ray rank-group backend tests: one local Ray session per module."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from rlspec.cluster.ray_utils import start_ray

    started = start_ray(None)
    yield
    if started:
        ray.shutdown()
