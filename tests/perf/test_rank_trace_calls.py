"""`RankTracer`'s per-call rows: every window's wall time and what changed in it (a Dynamo recompile shows)."""

from __future__ import annotations

import json

import torch

from rlspec.perf.rank_trace import CALL_ENV, TRACE_ENV, RankTracer, table


def test_every_call_gets_a_row_and_a_recompile_for_a_new_shape_is_counted(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_ENV, str(tmp_path))
    monkeypatch.setenv(CALL_ENV, "1")
    tracer = RankTracer(0)
    torch._dynamo.reset()
    double = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    for rows in (4, 4, 8, 8):  # a new shape on the third call: a graph compiled again
        tracer.begin("train")
        double(torch.ones(rows))
        tracer.end("train")
    calls = [json.loads(line) for line in (tmp_path / "rank0_calls.jsonl").read_text().splitlines()]
    assert [c["call"] for c in calls] == [0, 1, 2, 3]
    assert [c["profiled"] for c in calls] == [False, True, False, False]
    assert [c["compiled_graphs"] for c in calls] == [1, 0, 1, 0]
    assert all(c["wall_s"] > 0 and c["phase"] == "train" for c in calls)
    summary = json.loads((tmp_path / "rank0_train.json").read_text())  # the profiled window's summary
    assert summary["host_ops_ms"] and all(ms >= 0 for ms in summary["host_ops_ms"].values())
    printed = table(tmp_path)
    assert "host ms, train rank 0: " in printed
    assert "rank 0 train 2: " in printed and "compiled_graphs 1" in printed and "train 1 (profiled)" in printed
