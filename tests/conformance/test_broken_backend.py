"""Proof the suite can fail: a backend with a realistic data-parallel bug must be caught, with the numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
from torch import Tensor

from rlspec.backends.standalone.backend import StandaloneBackend
from rlspec.core.batch import TrainBatch
from rlspec.conformance import run_suite
from rlspec.core.grpo import LossNorm
from rlspec.core.policy import accumulate, add_stats
from rlspec.spec import BackendCaps, RunPlan

NUM_FAKE_RANKS = 2


class LocalTokenMeanBackend:
    """Two in-process "data-parallel ranks" that each normalise token-mean by their LOCAL token count and
    average their gradients — the classic DDP token-mean bug (right only when ranks hold equal token counts)."""

    caps = BackendCaps(name="broken_local_norm", sync_methods=("shared",), supports_lora=True, max_trainer_ranks=1,
                       single_process=True)

    def __init__(self) -> None:
        self.inner = StandaloneBackend()

    def setup(self, plan: RunPlan) -> None:
        self.inner.setup(plan)

    def rollout_engine(self):
        return self.inner.rollout_engine()

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> Tensor:
        return self.inner.logprobs(batch, reference)

    def forward_backward(self, batch: TrainBatch, norm: LossNorm) -> dict[str, float]:
        trainer = self.inner.trainer
        parts = []
        for rank in range(NUM_FAKE_RANKS):
            shard = batch.shard(rank, NUM_FAKE_RANKS)
            local = LossNorm.of(shard.loss_mask, norm.max_new_tokens)  # the bug: should be the global `norm`
            parts.append(accumulate(trainer.model, shard, trainer.algo.micro_batch_size, local, trainer.loss_cfg,
                                    trainer.temperature, lambda loss: (loss / NUM_FAKE_RANKS).backward(),
                                    trainer.device))
        stats = add_stats(*parts)
        stats["loss"] /= NUM_FAKE_RANKS  # what an averaging all-reduce of the loss would report
        return stats

    def optimizer_step(self) -> float:
        return self.inner.optimizer_step()

    def export_weights(self) -> Iterator[tuple[str, Tensor]]:
        return self.inner.export_weights()

    def save(self, path: Path) -> None:
        self.inner.save(path)

    def load(self, path: Path) -> None:
        self.inner.load(path)

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_local_token_count_normalisation_is_caught() -> None:
    report = run_suite({"broken_local_norm": LocalTokenMeanBackend},
                       cases=["token_mean_sgd", "seq_mean_token_mean_sgd_kl_k3"], sync=False)
    assert not report.passed
    failing = {(c.case, c.metric) for c in report.failures()}
    # token-mean is wrong from the first step on: loss, grad norm and the final weights
    for metric in ("loss/step0", "grad_norm/step0", "weights/max_abs_diff"):
        assert ("token_mean_sgd", metric) in failing
    # the bug does not touch seq-mean-token-mean (equal sequences per shard): the suite says so, no false alarm
    assert not any(case == "seq_mean_token_mean_sgd_kl_k3" for case, _ in failing)
    message = report.failure_message()
    print(message)
    line = next(l for l in message.splitlines() if "grad_norm/step0" in l)
    assert "broken_local_norm" in line and "token_mean_sgd" in line
    assert "backend " in line and "vs reference " in line and "> tolerance" in line
    with pytest.raises(AssertionError, match="grad_norm/step0"):
        report.raise_for_failures()


def test_cli_exits_1_and_json_names_the_failures(tmp_path, monkeypatch, capsys) -> None:
    from rlspec.conformance import cli, suite

    monkeypatch.setattr(suite, "backend_class", lambda name: LocalTokenMeanBackend)
    out = tmp_path / "conf.json"
    assert cli.main("broken_local_norm", str(out), None) == 1
    report = json.loads(out.read_text())
    assert report["passed"] is False
    failed = {(c["case"], c["metric"]) for c in report["checks"] if not c["passed"]}
    assert ("token_mean_adamw_microbatch", "grad_norm/step0") in failed
    assert ("token_mean_sgd", "weights/max_abs_diff") in failed
    assert "conformance FAILED" in capsys.readouterr().out
