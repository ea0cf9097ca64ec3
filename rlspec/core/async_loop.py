"""`rollout.mode=async`: a rollout loop fills a bounded pool while the trainer consumes it.

    rollout loop (a thread):  wait until the engine's weights are fresh enough for step s
                              -> rollout_batch(s) -> pool.put(batch s, policy version)
    trainer (this thread):    pool.get(s) -> update -> push weights every sync.every_n_steps

Policy versions count trainer steps: the weights after s optimizer steps are version s, and the
engine holds the version of its last push. The batch the trainer consumes at step s was sampled by
version v <= s; its staleness s - v is at most `rollout.max_staleness` = k because the rollout loop
starts batch s only once the engine holds version >= s - k. So the pool never holds more than k + 1
batches (its bound), and with k = 0 every batch is sampled by the weights of the step before, in the
same order and with the same seeds as `rollout.mode=sync`: the numbers are the synchronous run's.

What overlaps: generation with the trainer's update. The engine must then hold its own weights (the
compiler refuses `sync.method=shared` with k > 0), and a push must not land in the middle of a
generation: both go through one lock here, so a push waits for the generation in flight (engines in
Ray actors serialise their calls anyway; an in-process engine would otherwise sample from
half-copied weights).

Lifecycle: the trainer decides the end. The rollout loop produces exactly the batches of the run's
steps and stops; it never closes the pool, so finishing first cannot cut the trainer short. The
trainer closes the pool when it leaves (done, or failed), which wakes and ends the rollout loop. A
failure in the rollout loop is kept in the pool and raised in the trainer at its next `get` as
`RunError` with the rollout loop's traceback; a failure in the trainer propagates as usual after the
rollout loop has been stopped.
"""

from __future__ import annotations

import collections
import threading
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator

from ..errors import RunError
from ..runtime.engine_state import EngineState, Pending
from ..runtime.metrics import PhaseTimer
from ..spec import RunPlan
from ..spec.evaluation import eval_due
from ..tasks import Task
from .backend import Backend
from .batch import TrainBatch
from .step import metrics_row, rollout_batch, served_version, update

JOIN_TIMEOUT_S = 60.0
"""How long the trainer waits, when it leaves, for the rollout loop to finish a generation in flight."""


@dataclass
class PooledBatch:
    """One step's batch as the rollout loop leaves it in the pool."""

    step: int
    batch: TrainBatch
    policy_version: int
    """Trainer steps behind the weights that sampled every sequence of the batch (one engine call)."""
    timer: PhaseTimer
    """The rollout loop's gen and reward times for this batch."""
    counters: dict[str, float]


class Pool:
    """A bounded, closable queue of batches, plus the engine's policy version the rollout loop waits on."""

    def __init__(self, capacity: int, version: int) -> None:
        self.capacity = capacity
        self._items: collections.deque[PooledBatch] = collections.deque()
        self._cond = threading.Condition()
        self._version = version
        self._closed = False
        self._error: tuple[BaseException, str] | None = None

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def put(self, item: PooledBatch) -> bool:
        """Add `item`, waiting while the pool is full; False once the pool is closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or len(self._items) < self.capacity)
            if self._closed:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def get(self) -> PooledBatch:
        """The oldest batch, waiting for one; raises the rollout loop's failure as `RunError`."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._error is not None or self._closed)
            if self._items:
                self._cond.notify_all()  # room for a waiting put
                return self._items.popleft()
            if self._error is not None:
                err, trace = self._error
                raise RunError(f"the rollout loop failed: {type(err).__name__}: {err}", trace)
            raise RunError("the pool was closed before the trainer's last step")

    def pending(self) -> list[Pending]:
        """The batches in the pool now, oldest first (what a checkpoint keeps of it)."""
        with self._cond:
            return [Pending(i.step, i.batch, i.policy_version, i.counters) for i in self._items]

    def wait_for_version(self, version: int) -> bool:
        """Wait until the engine holds policy `version` or newer; False once the pool is closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._version >= version)
            return not self._closed

    def set_version(self, version: int) -> None:
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def fail(self, err: BaseException) -> None:
        """Record the rollout loop's failure (with its traceback, or a remote worker's) for the trainer."""
        trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        if isinstance(err, RunError) and err.worker_traceback:
            trace += "--- worker traceback ---\n" + err.worker_traceback
        with self._cond:
            self._error = (err, trace)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class LockedEngine:
    """The engine as both loops see it: a generation and a weight push never interleave."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._lock = threading.RLock()  # the trainer pushes inside its own `exclusive` hold (an eval follows)
        self.version = 0
        """Policy version of the engine's weights (written only under the lock)."""
        self.sampled_version = 0
        """Version of the weights behind the last `generate` (read by the rollout loop, its only caller): the one a
        rollout server reports its samples were drawn with (`Rollout.weight_version`: a push waits for the rows in
        flight there, so it is exact), else the version of the last push here."""

    def generate(self, prompts: list[str], n: int, seed: int):
        with self._lock:
            rollout = self.engine.generate(prompts, n, seed)
            reported = getattr(rollout, "weight_version", None)
            self.sampled_version = reported if reported is not None else self.version
            return rollout

    @contextmanager
    def exclusive(self):
        """The engine alone, between generations and pushes (an eval), without touching `sampled_version`."""
        with self._lock:
            yield self.engine

    def push(self, transport, weights, version: int) -> int:
        with self._lock:
            sent = transport.push(weights, self.engine)
            self.version = version
            served_version(self.engine, version)
            return sent


def rollout_loop(plan: RunPlan, engine: LockedEngine, task: Task, pool: Pool, pad_id: int, start_step: int) -> None:
    """Produce the batches of steps `start_step ..` into `pool`, each as soon as the weights allow."""
    spec = plan.spec
    try:
        for step in range(start_step, spec.algorithm.steps):
            if not pool.wait_for_version(step - spec.rollout.max_staleness):
                return
            timer = PhaseTimer()
            batch, counters = rollout_batch(plan, engine, task, step, pad_id, timer)
            if not pool.put(PooledBatch(step, batch, engine.sampled_version, timer, counters)):
                return
    except BaseException as err:  # noqa: BLE001 - handed to the trainer, which ends the run with it
        pool.fail(err)


def async_steps(plan: RunPlan, backend: Backend, engine, task: Task, transport, weights, pad_id: int,
                start_step: int, evaluator=None, state: EngineState | None = None,
                pending: list[Pending] = ()) -> Iterator[dict]:
    """One metrics row per step, trained from the pool while the rollout loop generates ahead. An eval
    (`evaluator`) follows a step's push under the same hold of the engine: no generation of the rollout loop comes
    between (the trainer waits for the eval's own generation only, and the rollout loop samples the batches it
    would have sampled without it). A resumed
    run starts from the engine's version in `state` and the batches that were `pending` in the pool
    (`rlspec.runtime.engine_state`), and keeps `state` current for the next checkpoint."""
    spec = plan.spec
    state = state if state is not None else EngineState(version=start_step)
    locked = LockedEngine(engine)
    locked.version = state.version  # a resumed run's engine holds the checkpoint's engine weights
    pool = Pool(capacity=spec.rollout.max_staleness + 1, version=state.version)
    for item in pending:
        pool.put(PooledBatch(item.step, item.batch, item.policy_version, PhaseTimer(), item.counters))
    state.pending = pool.pending
    producer = threading.Thread(target=rollout_loop,
                                args=(plan, locked, task, pool, pad_id, start_step + len(pending)),
                                name="rlspec-rollout", daemon=True)
    producer.start()
    prepare = getattr(backend, "prepare_update", None)  # optional (`rlspec.core.backend.Backend`)
    try:
        for step in range(start_step, spec.algorithm.steps):
            evaluating = evaluator is not None and eval_due(spec.eval, step, spec.algorithm.steps)
            with ExitStack() as holding:
                timer = PhaseTimer()
                with timer("step"):
                    waiting = len(pool)
                    if prepare is not None:  # beside the wait for the batch
                        prepare()
                    with timer("wait"):
                        item = pool.get()
                    assert item.step == step, (item.step, step)
                    with timer("train"):
                        result = update(plan, backend, item.batch)
                    sync_bytes = 0
                    if (step + 1) % spec.sync.every_n_steps == 0:
                        with timer("sync"):
                            if evaluating:  # the engine kept from the push to the eval's end
                                held = holding.enter_context(locked.exclusive())
                            sync_bytes = locked.push(transport, weights, step + 1)
                        pool.set_version(step + 1)
                        state.version = step + 1
                timer.update({k: v for k, v in item.timer.items() if k != "step"})
                row = metrics_row(plan, step, result, timer, sync_bytes, item.counters)
                row.update({"async/staleness_mean": float(step - item.policy_version), "async/pool_size": waiting,
                            "timing_s/wait": timer["wait"]})
                if evaluating:  # an eval falls on a step that syncs (`check_eval_cadence`)
                    row.update(evaluator.run(held, step))
            yield row
    finally:
        pool.close()
        producer.join(JOIN_TIMEOUT_S)
