"""The GRPO step template, shared by every backend.

    sample prompts -> engine.generate -> rewards -> group advantages -> collate
      -> [old log-probs if several updates] -> [reference log-probs if KL]
      -> per mini-batch: backend.forward_backward + backend.optimizer_step
      -> sync weights to the engine (every N steps) -> metrics, checkpoint

`rollout.mode=async` runs the first line in a rollout loop of its own (`rlspec.core.async_loop`), built
from the same pieces as this one (`rlspec.core.step`: `rollout_batch`, `update`, `metrics_row`).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..runtime.checkpoints import Checkpoints
from ..runtime.engine_state import EngineState, RunSaver, read_engine_state
from ..runtime.loggers import Loggers
from ..runtime.metrics import MetricsLog, PhaseTimer
from ..runtime.monitor import RunMonitor, StepAbandoned
from ..spec import RunPlan
from ..spec.evaluation import eval_due
from ..tasks import Task
from .backend import Backend, weight_source_of
from .step import env_rollouts, metrics_row, replica_metrics, rollout_batch, served_version, update

if TYPE_CHECKING:
    from ..agent.gateway import AgentGateway
    from ..evaluation.runner import Evaluator


def train(plan: RunPlan, backend: Backend, task: Task, transport, out_dir: Path, pad_id: int,
          start_step: int = 0, progress: bool | None = None, monitor: RunMonitor | None = None,
          loggers: Loggers | None = None, evaluator: Evaluator | None = None) -> None:
    """Run steps `start_step .. algorithm.steps - 1`; checkpoint every N steps and at the end; each step's metrics
    to metrics.jsonl, TensorBoard and the started `loggers` (`rlspec.runtime.loggers`).

    `evaluator` (the spec's `eval`) scores the engine's weights before the first step and after the steps the
    spec names, its metrics joining that step's row; `checkpoint.keep_best` then saves and keeps by them.

    `monitor` sees each step's metrics: it raises on non-finite numbers (before the checkpoint) and asks
    for a checkpoint and a stop when a SIGTERM came (`rlspec.runtime.monitor`)."""
    spec = plan.spec
    engine = backend.rollout_engine()
    weights = weight_source_of(backend)
    replicated = hasattr(engine, "replicas")
    if replicated:  # several rollout servers: the transport once per server (`sync.replicas`)
        from ..sync.replicas import PerReplica

        transport = PerReplica(transport)
    transport.connect(engine, weights)
    if hasattr(engine, "reconnecting"):  # a rollout server, which may be lost and come back
        transport = engine.reconnecting(transport, weights)
    checkpoints = Checkpoints(out_dir / "checkpoints", spec.checkpoint.keep_last, spec.checkpoint.save_optimizer)
    checkpoints.remove_leftovers()
    # A resumed run's engine gets what it held when the checkpoint was written (`rlspec.runtime.engine_state`).
    resumed = read_engine_state(checkpoints.latest()) if start_step else None
    state = EngineState(version=start_step, lags=plan.sync_method != "shared")
    if resumed is not None and resumed[1] is not None:  # it lagged the trainer: its own weights back
        engine.load_weights(resumed[1].items())
        state.version = resumed[0]
        served_version(engine, state.version)
    elif start_step or not getattr(engine, "starts_in_sync", True):
        # Resumed, or a joined rollout server: the engine holds other weights than the trainer's.
        transport.push(weights, engine)
        served_version(engine, start_step)
    saver = RunSaver(backend, engine, state)
    log = MetricsLog(out_dir, spec.algorithm.steps, start_step, progress=progress,
                     tensorboard=spec.logging.tensorboard, loggers=loggers)
    best = None
    if spec.checkpoint.keep_best is not None:
        from ..evaluation.best import BestCheckpoints

        best = BestCheckpoints(checkpoints, spec.checkpoint, start_step)
    if evaluator is not None and spec.eval.before_train and start_step == 0:
        log.log_eval(-1, evaluator.run(engine, -1))
    envs = env_rollouts(plan, engine)
    gateway = None
    if spec.rollout.agent.enabled:
        from ..agent.gateway import AgentGateway

        gateway = AgentGateway(plan, engine)
    if spec.rollout.mode == "async":
        from .async_loop import async_steps

        rows = async_steps(plan, backend, engine, task, transport, weights, pad_id, start_step, evaluator, state,
                           resumed[2] if resumed is not None else [])
    else:
        rows = sync_steps(plan, backend, engine, task, transport, weights, pad_id, start_step, envs, gateway, monitor,
                          evaluator, state)
    done = saved = None  # the last step completed here, the last checkpoint written here
    try:
        for row in rows:
            log.log(row)
            step = done = row["step"]
            stop = monitor is not None and monitor.step_done(step, row)
            last = step == spec.algorithm.steps - 1
            every = spec.checkpoint.every_n_steps
            scored = best is not None and best.record(step, row)  # before the save prunes
            if last or stop or scored or (every and (step + 1) % every == 0):
                saved = checkpoints.save(step, saver.at(step), {"backend": plan.backend})
                if stop and not last:
                    raise monitor.stopped(step, saved)
    except BaseException as err:
        if not _abandoned(err):
            raise
        # A stop signal while sampling: the weights are still those of the last completed step.
        if done is not None and (saved is None or saved.name != f"step_{done:06d}"):
            saved = checkpoints.save(done, saver.at(done), {"backend": plan.backend})
        raise monitor.stopped(done if done is not None else start_step - 1, saved or checkpoints.latest()) from None
    finally:
        rows.close()  # async: closes the pool and ends the rollout loop
        if replicated:
            transport.close()
        if gateway is not None:
            gateway.close()
        log.close()
        if envs is not None:
            envs.close()


def sync_steps(plan: RunPlan, backend: Backend, engine, task: Task, transport, weights, pad_id: int,
               start_step: int, envs=None, gateway: AgentGateway | None = None,
               monitor: RunMonitor | None = None, evaluator: Evaluator | None = None,
               state: EngineState | None = None) -> Iterator[dict]:
    """One metrics row per step, each step in turn: generate (or run the environments' episodes), train, sync,
    [eval]. A stop signal while a step samples abandons it (`RunMonitor.abandonable`)."""
    spec = plan.spec
    prepare = getattr(backend, "prepare_update", None)  # optional (`rlspec.core.backend.Backend`)
    for step in range(start_step, spec.algorithm.steps):
        timer = PhaseTimer()
        with timer("step"):
            if prepare is not None:
                prepare()
            with monitor.abandonable() if monitor is not None else nullcontext():
                if envs is None:
                    batch, counters = rollout_batch(plan, engine, task, step, pad_id, timer, gateway)
                else:
                    batch, counters = envs.rollout_batch(step, timer)
            with timer("train"):
                result = update(plan, backend, batch)
            sync_bytes = 0
            if (step + 1) % spec.sync.every_n_steps == 0:
                with timer("sync"):
                    sync_bytes = transport.push(weights, engine)
                served_version(engine, step + 1)
                if state is not None:
                    state.version = step + 1
        extra = {**counters, **replica_metrics(engine, transport)}
        if evaluator is not None and eval_due(spec.eval, step, spec.algorithm.steps):  # between steps, on the engines
            extra.update(evaluator.run(engine, step))
        yield metrics_row(plan, step, result, timer, sync_bytes, extra)


def _abandoned(err: BaseException) -> bool:
    """Whether `err` is the monitor's `StepAbandoned`, or arose from it: the signal handler raises it wherever
    the main thread is, and inside Ray's `ray.wait` the C extension turns it into a `SystemError` caused by it."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, StepAbandoned):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False
