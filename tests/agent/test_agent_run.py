"""`rlspec run` with an agent, end to end (in-process, to save an interpreter start): the engine is a `rlspec
serve` process (hardware.rollout=separate), the agent talks to it through the gateway, the loop trains on
the kept trajectories and logs the `agent/*` counts; a run whose agent always fails raises `RunError`
(exit 1) with the agent's traceback."""

from __future__ import annotations

import json

import pytest

from rlspec.errors import RunError
from rlspec.run import run
from tests.conftest import REPO

SPEC = "examples/agent_copy_two_turn.yaml"
SHORT = ["algorithm.steps=1", "rollout.prompts_per_step=1", "algorithm.group_size=4", "algorithm.micro_batch_size=4"]


def test_agent_run_through_a_rollout_server(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = run(SPEC, [*SHORT, "hardware.rollout=separate"], out=str(tmp_path / "run"), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0]
    for row in rows:
        assert row["agent/trajectories"] == 4 and row["agent/failed"] == 0 and row["agent/turns_mean"] == 2.0
        assert 0 < row["response_len/mean"] <= 8 and row["sync/bytes"] > 0


@pytest.mark.parametrize("processes", [0, 2])
def test_a_chat_agent_runs_through_a_rollout_server(tmp_path, monkeypatch, processes):
    """The chat turns reach the server as token ids (the earlier turns' sampled ids spliced in); in agent processes
    too, where each turn goes to the run's process as a call that runs beside its engine thread."""
    pytest.importorskip("openai")
    monkeypatch.chdir(REPO)
    out = run(SPEC, [*SHORT, "hardware.rollout=separate", "rollout.agent.function=examples/agents/chat_tool.py:solve",
                     f"rollout.agent.processes={processes}"], out=str(tmp_path / "run"), progress=False)
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["agent/trajectories"] == 4 and row["agent/failed"] == 0 and row["agent/turns_mean"] == 2.0


def test_a_run_whose_agent_fails_stops_with_the_agents_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(RunError) as err:
        run(SPEC, [*SHORT, "rollout.agent.function=tests.agent.agents:always_raises"], out=str(tmp_path / "run"),
            progress=False)
    assert "step 0: 4 of 4 agent trajectories failed" in str(err.value)
    assert 'raise RuntimeError("the agent broke")' in str(err.value)
