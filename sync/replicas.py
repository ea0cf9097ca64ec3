"""The configured transport once per rollout replica, for an engine made of several (`engine.replicas`: the
standalone backend's rollout servers, `rlspec.serve.client`).

Each replica gets a transport of its own, connected to it alone, and a push runs them all at once (one thread
each; the first push one after another) and returns the bytes sent in all. A replica that exposes `reconnecting` (a rollout server) wraps its
transport, so a lost server recovers its own channel without touching the others'. The cost against one
broadcast group to every replica: the sender sends the weights once per replica (its link's bandwidth shared
by the pushes in flight), where a broadcast sends about one copy whatever the count; `metrics` reports each
replica's push time so that the count's cost shows.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait


class PerReplica:
    """`first` (the run's transport, closed by its owner) serves replica 0; the others get fresh ones built like it."""

    def __init__(self, first) -> None:
        self.first = first
        self.transports: list = []
        self.replicas: list = []
        self.pool: ThreadPoolExecutor | None = None
        self.last_push_s: list[float] = []
        self.pushed = False

    def connect(self, engine, weights=None) -> None:
        from . import build_transport

        self.replicas = list(engine.replicas)
        made = [self.first] + [build_transport(self.first.name, self.first.spec) for _ in self.replicas[1:]]
        self.transports = made  # closed by `close` even when a later connect fails
        for transport, replica in zip(made, self.replicas):
            transport.connect(replica, weights)
        self.transports = [replica.reconnecting(t, weights) if hasattr(replica, "reconnecting") else t
                           for t, replica in zip(made, self.replicas)]
        self.pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="rlspec-push")

    def push(self, weights, engine) -> int:
        """Push to every replica at once; wait for all, then raise the first failure (in replica order). The first
        push goes to one replica after another: there each transport lays out its buffers and, on CUDA, captures
        its checksum graphs, which is kept out of the other pushes' way."""
        def one(transport, replica) -> tuple[int, float]:
            start = time.perf_counter()
            sent = transport.push(weights, replica)
            return sent, time.perf_counter() - start

        if not self.pushed:
            results = [one(t, r) for t, r in zip(self.transports, self.replicas)]
            self.pushed = True
        else:
            futures = [self.pool.submit(one, t, r) for t, r in zip(self.transports, self.replicas)]
            wait(futures)
            results = [f.result() for f in futures]
        self.last_push_s = [seconds for _, seconds in results]
        return sum(sent for sent, _ in results)

    def metrics(self) -> dict[str, float]:
        """Each replica's time for the last push (`timing_s/sync_replica_<i>`), once: empty until the next push."""
        out = {f"timing_s/sync_replica_{i}": s for i, s in enumerate(self.last_push_s)}
        self.last_push_s = []
        return out

    def close(self) -> None:
        """Close the transports this one built (the first is its owner's to close)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        for transport in self.transports[1:]:
            transport.close()
        self.transports = self.transports[:1]
