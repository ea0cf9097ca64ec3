"""Weights & Biases (offline) and MLflow (a local file store) receive what metrics.jsonl holds, through the real
libraries; a logger that cannot start refuses the run (exit 2, nothing written); one that fails mid-run is dropped
with a warning and the run goes on."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from rlspec.cli import main
from rlspec.runtime.loggers import MLflowLogger, mlflow_name, numeric
from rlspec.runtime.metrics import read_metrics

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "examples" / "tiny.yaml")
FAST = ["algorithm.steps=3", "rollout.prompts_per_step=2", "algorithm.group_size=2", "algorithm.micro_batch_size=4",
        "rollout.max_new_tokens=4", "checkpoint.every_n_steps=0", "checkpoint.save_optimizer=false"]


@pytest.fixture
def file_store(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this to use a file store
    monkeypatch.setenv("WANDB_SILENT", "true")
    return (tmp_path / "mlruns").as_uri()


def _wandb_records(path: Path) -> list:
    """The protobuf records of an offline run's transaction log (W&B's LevelDB-style log: 32 KiB blocks of records,
    each with a 7-byte header: CRC, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, records, parts = path.read_bytes(), [], b""
    assert data[:4] == b":W&B"
    pos = 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def _wandb_run(out: Path) -> tuple[dict, list[dict]]:
    """(config, history rows) of the one offline run under `out`."""
    [log] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    config, history = {}, []
    for record in _wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.append({k: v for k, v in row.items() if not k.startswith("_")} | {"step": row["_step"]})
    return config, history


def _mlflow_run(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("rlspec").experiment_id])
    return client, run


def _expected(out: Path) -> list[dict]:
    return [numeric(row) | {"step": row["step"]} for row in read_metrics(out / "metrics.jsonl")]


def test_wandb_offline_and_mlflow_file_store_hold_the_metrics_of_metrics_jsonl(tmp_path, file_store, capsys):
    out = tmp_path / "run"
    assert main(["run", TINY, *FAST, "logging.wandb.enabled=true", "logging.wandb.mode=offline",
                 "logging.wandb.run_name=tiny-w", "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={file_store}",
                 "eval.at_end=true", "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    expected = _expected(out)
    assert [row["step"] for row in expected] == [0, 1, 2] and "reward/mean" in expected[0]
    assert "eval/mean@1" in expected[2]  # the eval's metrics, in the row of the step it follows

    config, history = _wandb_run(out)
    assert history == [pytest.approx(row, rel=1e-12) for row in expected]
    assert config["spec"]["algorithm"]["steps"] == 3 and config["backend"] == "standalone"

    client, run = _mlflow_run(file_store)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    logged = {}
    for key in {k for row in expected for k in row}:
        if key != "step":  # eval/mean@1 is eval/mean_at_1 there (MLflow refuses an @ in a name)
            for metric in client.get_metric_history(run.info.run_id, mlflow_name(key)):
                logged.setdefault(metric.step, {"step": metric.step})[key] = metric.value
    assert [logged[step] for step in sorted(logged)] == [pytest.approx(row, rel=1e-12) for row in expected]
    assert run.data.params["spec.algorithm.steps"] == "3"
    plan = json.loads(Path(client.download_artifacts(run.info.run_id, "plan.json", str(tmp_path))).read_text())
    assert plan["spec"]["logging"]["mlflow"]["tracking_uri"] == file_store


def test_a_logger_that_cannot_start_refuses_the_run(tmp_path, file_store, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # MLflow 3 then refuses a file store
    out = tmp_path / "refused"
    code = main(["run", TINY, *FAST, "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={file_store}",
                 "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "rlspec: error: logging.mlflow" in err and "MLFLOW_ALLOW_FILE_STORE" in err
    assert not out.exists()


def test_a_logger_that_fails_mid_run_is_dropped_and_the_run_goes_on(tmp_path, file_store, monkeypatch, capsys):
    logged = MLflowLogger.log

    def fails_at_step_1(self, metrics, step):
        if step == 1:
            raise ConnectionError("tracking server went away")
        logged(self, metrics, step)

    monkeypatch.setattr(MLflowLogger, "log", fails_at_step_1)
    out = tmp_path / "run"
    code = main(["run", TINY, *FAST, "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={file_store}",
                 "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "rlspec: warning: logging.mlflow failed at step 1 (ConnectionError: tracking server went away)" in err
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    client, run = _mlflow_run(file_store)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [0]


def test_plan_refuses_a_logger_whose_package_is_missing(monkeypatch):
    import importlib.util

    from rlspec.plan import build_plan
    from rlspec.spec import SpecError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(SpecError, match=r"logging.wandb.enabled: needs the wandb package.*rlspec\[loggers\]"):
        build_plan(TINY, ["logging.wandb.enabled=true"], full=False)
    build_plan(TINY, ["logging.mlflow.enabled=true"], full=False)
