"""Loggers beside metrics.jsonl: Weights & Biases and MLflow, through their own client libraries (`rlspec[loggers]`).

`start_loggers` opens each enabled logger's run before training, with the plan as its config; one that cannot start
is bad input (`SpecError`, exit 2). `MetricsLog` hands each step's numeric metrics to `Loggers.log` after writing the
step to metrics.jsonl; a logger that raises there is stopped with a warning and the run goes on.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Protocol, Sequence

from ..spec import RunPlan, SpecError
from ..spec.resume import flatten

INSTALL_HINT = "pip install 'rlspec[loggers]'"


class Logger(Protocol):
    name: str
    """The spec key that enabled it, e.g. `logging.wandb`."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """One step's numeric metrics."""

    def close(self, failed: bool) -> None:
        """End the logger's run, marked failed when the training run failed."""


class Loggers:
    """The started loggers of one run. The run closes them; a logger that raises is dropped with a warning."""

    def __init__(self, loggers: Sequence[Logger] = ()) -> None:
        self.active = list(loggers)

    def log(self, metrics: dict[str, float], step: int, kept_in: Path) -> None:
        for logger in list(self.active):
            try:
                logger.log(metrics, step)
            except Exception as err:  # noqa: BLE001 - a logger's failure must not end the training run
                self._drop(logger, f"failed at step {step}", err, kept_in)

    def close(self, failed: bool, kept_in: Path) -> None:
        """`failed`: the run is ending on an error (each logger marks its run failed)."""
        for logger in list(self.active):
            try:
                logger.close(failed)
            except Exception as err:  # noqa: BLE001
                self._drop(logger, "failed to close its run", err, kept_in)
        self.active = []

    def _drop(self, logger: Logger, what: str, err: BaseException, kept_in: Path) -> None:
        self.active.remove(logger)
        print(f"rlspec: warning: {logger.name} {what} ({type(err).__name__}: {str(err)[:300]}); it logs no more, the "
              f"run goes on and {kept_in} holds every step", file=sys.stderr, flush=True)


def check_loggers(plan: RunPlan) -> None:
    """At plan time, without importing them: each enabled logger's package is installed (`SpecError` otherwise)."""
    import importlib.util

    spec = plan.spec.logging
    for enabled, key, module in ((spec.wandb.enabled, "logging.wandb.enabled", "wandb"),
                                 (spec.mlflow.enabled, "logging.mlflow.enabled", "mlflow")):
        if enabled and importlib.util.find_spec(module) is None:
            raise SpecError(key, f"needs the {module} package, not installed in this environment",
                            f"{INSTALL_HINT}, or set {key}=false")


def start_loggers(plan: RunPlan, out_dir: Path, start_step: int) -> Loggers:
    """A started logger per enabled `logging.*` section; `SpecError` naming the section if one cannot start
    (the ones already started are closed first)."""
    spec = plan.spec.logging
    makers = [(spec.wandb.enabled, WandbLogger), (spec.mlflow.enabled, MLflowLogger)]
    started = Loggers()
    try:
        for enabled, maker in makers:
            if enabled:
                started.active.append(maker(plan, out_dir, start_step))
    except BaseException:
        started.close(True, out_dir / "metrics.jsonl")
        raise
    return started


def numeric(row: dict) -> dict[str, float]:
    """The row's numbers (bools as 0/1), without `step`, strings or nulls (a non-finite value is written as null)."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


def _run_name(name: str | None, out_dir: Path) -> str:
    return name or out_dir.resolve().name


class WandbLogger:
    name = "logging.wandb"

    def __init__(self, plan: RunPlan, out_dir: Path, start_step: int) -> None:
        spec = plan.spec.logging.wandb
        try:
            import wandb
        except ImportError:
            raise SpecError("logging.wandb.enabled", "needs the wandb package, not installed in this environment",
                            f"{INSTALL_HINT}, or set logging.wandb.enabled=false") from None
        config = {**plan.to_dict(), "start_step": start_step, "out_dir": str(out_dir)}
        files = out_dir / "wandb"
        existed = files.exists()
        try:
            # console="off": the run's own RunLog already tees stdout/stderr into OUT/run.log.
            self.run = wandb.init(project=spec.project, entity=spec.entity, name=_run_name(spec.run_name, out_dir),
                                  mode=spec.mode, dir=str(out_dir), config=config, tags=list(spec.tags) or None,
                                  reinit="create_new", settings=wandb.Settings(console="off", silent=True))
        except Exception as err:  # noqa: BLE001 - wandb raises many types (usage, auth, network, timeout)
            if not existed:  # a refused run leaves nothing behind
                shutil.rmtree(files, ignore_errors=True)
            raise SpecError(self.name, f"Weights & Biases did not start a run: {type(err).__name__}: {str(err)[:300]}",
                            "check logging.wandb.project and .entity and the login (`wandb login` or WANDB_API_KEY), "
                            "or set logging.wandb.mode=offline") from None

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def mlflow_name(key: str) -> str:
    """`key` as MLflow takes a metric name (alphanumerics and _ - . : / and spaces): `eval/pass@4` is
    `eval/pass_at_4`, any other character an underscore."""
    return re.sub(r"[^\w\-.:/ ]", "_", key.replace("@", "_at_"), flags=re.ASCII)


class MLflowLogger:
    name = "logging.mlflow"

    def __init__(self, plan: RunPlan, out_dir: Path, start_step: int) -> None:
        spec = plan.spec.logging.mlflow
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise SpecError("logging.mlflow.enabled", "needs the MLflow client (mlflow-skinny), not installed in this "
                            "environment", f"{INSTALL_HINT}, or set logging.mlflow.enabled=false") from None
        try:
            self.client = MlflowClient(tracking_uri=spec.tracking_uri)
            experiment = self.client.get_experiment_by_name(spec.experiment)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(spec.experiment)
            run = self.client.create_run(experiment_id, run_name=_run_name(spec.run_name, out_dir),
                                         tags={"rlspec.out_dir": str(out_dir), "rlspec.start_step": str(start_step)})
            self.run_id = run.info.run_id
            flat = flatten(plan.to_dict())
            params = [Param(key, json.dumps(value)[:6000]) for key, value in sorted(flat.items())]
            for first in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
                self.client.log_batch(self.run_id, params=params[first:first + 100])
            self.client.log_dict(self.run_id, plan.to_dict(), "plan.json")
        except Exception as err:  # noqa: BLE001 - MLflow raises many types (store, network, permissions)
            raise SpecError(self.name, f"MLflow did not start a run: {type(err).__name__}: {str(err)[:800]}",
                            "check logging.mlflow.tracking_uri (a server that answers, or a store this user can "
                            "write) and logging.mlflow.experiment") from None

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_name(key), value, now_ms, step)
                                                    for key, value in metrics.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
