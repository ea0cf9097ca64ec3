"""Several rollout servers behind one `RolloutEngine`: `ServedReplicas`, the standalone backend's engine when
`hardware.num_rollout_engines` > 1 (servers it starts, one per engine device, or joins: `rollout.server_urls`).

- **Sampling.** A step's prompt groups are split into contiguous runs of whole groups, as even as they go
  (sizes differ by at most one group); every server gets its run in one completions request, all requests in
  flight at once. Each request carries `first_sample`, the index of its first sample in the step, so sample i of
  the step draws the noise of sample i whichever server runs it: the step's samples equal one server's.
- **Weights.** Each server has a transport of its own (`sync.replicas.PerReplica`: the configured transport
  once per server, pushed concurrently), not one broadcast group to all: a lost server then takes only its own
  channel down, and comes back (restarted or waited for, reconnected, re-pushed) through its own `ServedEngine`
  while the others keep theirs. The price is the trainer sending the weights once per server (its link's
  bandwidth shared by the pushes in flight) where a broadcast would send them about once.
- **Reliability.** Each server is a `ServedEngine`, with its recovery: a server lost mid-step is restarted or
  waited for, gets the current weights, and re-runs its own part of the step; the other parts are kept.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable, Sequence

from torch import Tensor

from ..core.batch import TrainBatch
from ..rollout.base import Rollout
from .client import ServedEngine


def split_groups(num_groups: int, num_parts: int) -> list[range]:
    """Contiguous runs of whole groups, one per part, sizes differing by at most one (the first parts the larger);
    a part with no group gets an empty range."""
    share, extra = divmod(num_groups, num_parts)
    parts, start = [], 0
    for i in range(num_parts):
        size = share + (i < extra)
        parts.append(range(start, start + size))
        start += size
    return parts


class ServedReplicas:
    """`RolloutEngine` over several rollout servers (see the module docstring); `replicas[i]` is server i's."""

    def __init__(self, replicas: Sequence[ServedEngine], tokenizer) -> None:
        self.replicas = list(replicas)
        self.tokenizer = tokenizer
        self.starts_in_sync = all(r.starts_in_sync for r in self.replicas)
        self.pool = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="rlspec-replica")
        self.last_generate: dict[str, float] = {}
        """Per server, the last `generate`'s seconds and samples (`metrics`)."""

    @property
    def label(self) -> str:
        return f"{len(self.replicas)} rollout servers ({', '.join(r.client.url for r in self.replicas)})"

    def _on_all(self, calls: Sequence[Callable[[], Any]]) -> list:
        """Run the calls concurrently, one per server; wait for all of them, then raise the first failure (in
        server order), so no request is left running behind a failed step."""
        futures = [self.pool.submit(call) for call in calls]
        wait(futures)
        return [f.result() for f in futures]

    def generate(self, prompts: list[str], n: int, seed: int, first_sample: int = 0, options=None) -> Rollout:
        parts = split_groups(len(prompts), len(self.replicas))

        def run(replica: ServedEngine, part: range) -> tuple[Rollout | None, float]:
            if not part:
                return None, 0.0
            start = time.perf_counter()
            extra = () if options is None else (options,)  # an eval's; a step's rollout passes none
            out = replica.generate(prompts[part.start:part.stop], n, seed, first_sample + part.start * n, *extra)
            return out, time.perf_counter() - start

        outs = self._on_all([lambda r=r, p=p: run(r, p) for r, p in zip(self.replicas, parts)])
        self.last_generate = {}
        for i, (part, (_, seconds)) in enumerate(zip(parts, outs)):
            self.last_generate[f"timing_s/gen_replica_{i}"] = seconds
            self.last_generate[f"rollout/samples_replica_{i}"] = float(len(part) * n)
        done = [out for out, _ in outs if out is not None]
        versions = [o.weight_version for o in done]
        return Rollout(*(sum((getattr(o, f) for o in done), []) for f in
                         ("prompt_ids", "completion_ids", "completion_logprobs", "texts")),
                       weight_version=None if None in versions or not versions else min(versions))

    def metrics(self) -> dict[str, float]:
        """Per server: the last step's generation seconds (`timing_s/gen_replica_<i>`: the step's `timing_s/gen`
        is the slowest one's plus the split) and samples (`rollout/samples_replica_<i>`)."""
        return dict(self.last_generate)

    def logprobs(self, batch: TrainBatch) -> Tensor:
        return self.replicas[0].logprobs(batch)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        named = [(name, t.detach().cpu()) for name, t in named_tensors]
        self._on_all([lambda r=r: r.load_weights(named) for r in self.replicas])

    def receive(self, fn, payload) -> list:
        """A transport's engine half in every server (a transport built for one engine per server goes through
        `replicas` instead: `sync.replicas.PerReplica`)."""
        return self._on_all([lambda r=r: r.receive(fn, payload) for r in self.replicas])

    def named_weights(self) -> list[tuple[str, Tensor]]:
        return self.replicas[0].named_weights()

    def set_weight_version(self, version: int) -> None:
        self._on_all([lambda r=r: r.set_weight_version(version) for r in self.replicas])

    def weight_versions(self) -> list[int | None]:
        """The weight version each server reports now (`/health`)."""
        return [r.client.health()["weight_version"] for r in self.replicas]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for replica in self.replicas:
            replica.client.close()
