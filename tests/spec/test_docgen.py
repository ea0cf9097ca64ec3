"""docs/spec.md is the schema's reference, generated: it must match the dataclasses as they are."""

from __future__ import annotations

from pathlib import Path

from rlspec.spec.docgen import COMMAND, DOC_PATH, render, sections

REPO = Path(__file__).resolve().parents[2]


def test_docs_spec_md_is_current():
    assert (REPO / DOC_PATH).read_text() == render(), f"{DOC_PATH} is out of date: run `{COMMAND}` from the repository root"


def test_every_key_is_documented_with_its_allowed_values():
    keys = {key.path: key for _, _, found in sections() for key in found}
    assert [path for path, key in keys.items() if not key.meaning] == []
    assert keys["algorithm.loss_agg"].allowed == "`token-mean` \\| `seq-mean-token-mean` \\| `seq-mean-token-sum-norm`"
    assert keys["rollout.task.judge.models"].default == "[]" and "rollout.task.judge.base_url" in keys
