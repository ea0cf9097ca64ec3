"""`rlspec.cluster.ray_utils.wait_all`: when one actor's task fails because a peer died (its collective lost the
connection first), the error names the dead actor; a failure with no death behind it is reported as itself."""

from __future__ import annotations

import os
import time

import pytest

from rlspec.cluster import ray_utils
from rlspec.errors import RunError


@pytest.fixture()
def peers(ray_session):
    import ray

    class Peer:  # defined here so Ray ships the class by value (workers cannot import a test module)
        def fail(self) -> None:
            raise RuntimeError("Connection reset by peer")

        def exit_after(self, delay_s: float) -> None:
            time.sleep(delay_s)
            os._exit(1)

        def block(self, seconds: float) -> None:
            time.sleep(seconds)

    actors = [ray.remote(Peer).remote() for _ in range(2)]
    yield actors
    for actor in actors:
        ray.kill(actor)


def test_a_failure_caused_by_a_dead_peer_names_the_dead_one(peers):
    survivor, killed = peers
    with pytest.raises(RunError) as caught:
        ray_utils.wait_all([survivor.fail.remote(), killed.exit_after.remote(1.0)], ["rank 0", "rank 1"])
    message = str(caught.value)
    assert message.startswith("rank 1 died"), message
    assert "then rank 0 failed: RuntimeError" in message and "Connection reset by peer" in message


def test_a_failure_with_no_death_is_reported_after_the_grace(peers, monkeypatch):
    monkeypatch.setattr(ray_utils, "DEATH_GRACE_S", 1.0)
    failing, blocked = peers
    start = time.monotonic()
    with pytest.raises(RunError, match="^rank 0 failed: RuntimeError"):
        ray_utils.wait_all([failing.fail.remote(), blocked.block.remote(60)], ["rank 0", "rank 1"])
    assert 1.0 <= time.monotonic() - start < 20
