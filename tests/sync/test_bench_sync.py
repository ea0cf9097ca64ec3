"""`python -m rlspec.perf.bench_sync` reports each push's phases: medians per phase, and a table of them."""

from __future__ import annotations

from rlspec.perf.bench_sync import _medians, _table
from rlspec.sync.staging import push_report


def test_push_report_splits_each_half_into_its_phases_and_the_call():
    report = push_report(0.010, {"sender": (0.006, {"bytes": 1, "times": {"export": 0.002, "stage": 0.001}}),
                                 "engine": (0.008, [{"times": {"copy": 0.001}}, {"times": {"copy": 0.003}}])})
    assert report["total_s"] == 0.010 and report["sender/export"] == 0.002
    assert abs(report["sender/call"] - 0.003) < 1e-12
    assert report["engine/copy"] == 0.003 and abs(report["engine/call"] - 0.005) < 1e-12  # the slowest engine
    assert push_report(0.001, {"engine": (0.001, None)})["engine/call"] == 0.001


def test_breakdown_medians_and_table():
    reports = [{"total_s": t, "sender/export": t / 2, "engine/call": 0.001} for t in (0.003, 0.001, 0.002)]
    reports[0]["engine/verify"] = 0.004  # a phase only one push had counts 0 in the others
    medians = _medians(reports)
    assert medians == {"engine/call": 0.001, "engine/verify": 0.0, "sender/export": 0.001, "total_s": 0.002}
    result = {"method": "nccl", "model": "m", "dtype": "float32", "bytes": 10**6, "num_tensors": 3, "device": "cpu",
              "repeats": 3, "raw_name": "broadcast", "breakdown_verified": medians, "breakdown_unverified": {}}
    for key in ("push_verified", "push_unverified", "raw"):
        result[key + "_s"], result[key + "_gb_per_s"] = 0.002, 0.5
    lines = _table(result).splitlines()
    phases = [line.split()[0] for line in lines[lines.index("") + 2:]]
    assert phases == ["total_s", "sender/export", "engine/verify", "engine/call"]
