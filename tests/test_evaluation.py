"""The `eval` section and `rlspec eval` (`rlspec.evaluation`): the metrics' math, bad input naming its key, the eval
sets, and a run whose training numbers do not move when it evaluates, reproduced by `rlspec eval` on its checkpoint."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from rlspec.evaluation.scores import Sample, pass_at_k, summarise
from rlspec.plan import build_plan
from rlspec.runtime.metrics import read_metrics
from rlspec.spec import SpecError

TINY = "examples/tiny.yaml"
DATASET = "examples/dataset_parquet.yaml"
TRAINING_ONLY = ("eval/", "timing_s/", "perf/", "mem/", "sync/gb_per_s")
"""Row keys that are not training numbers (eval metrics; wall-clock and memory readings)."""


def test_pass_at_k_is_the_unbiased_estimator():
    """1 - C(n-c, k)/C(n, k) equals the share of the k-subsets of n samples that hold a passing one."""
    for n, c, k in [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 5, 2), (3, 3, 3)]:
        passed = [i < c for i in range(n)]
        subsets = list(itertools.combinations(passed, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_summarise_overall_per_source_majority_and_failed_rewards():
    samples = [Sample(1.0, 3, False, "7"), Sample(0.0, 8, True, "5"), Sample(1.0, 2, False, "7"),   # prompt 0
               Sample(0.0, 4, False, "2"), Sample(math.nan, 8, True, None), Sample(0.0, 5, False, "2")]  # prompt 1
    m = summarise(samples, 3, [1, 2], None, True, sources=["math", "code"])
    assert m["eval/mean@3"] == pytest.approx(2 / 5)  # the failed sample is left out
    assert m["eval/best@3"] == pytest.approx(0.5)
    assert m["eval/pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert m["eval/pass@2"] == pytest.approx((1 + 0) / 2)
    assert m["eval/maj@3"] == pytest.approx(0.5)  # "7" wins prompt 0 (reward 1), "2" prompt 1 (0)
    assert m["eval/reward_errors"] == 1 and m["eval/num_prompts"] == 2
    assert m["eval/response_len/mean"] == pytest.approx(30 / 6) and m["eval/truncated_frac"] == pytest.approx(2 / 6)
    assert m["eval/math/mean@3"] == pytest.approx(2 / 3) and m["eval/code/best@3"] == 0.0


@pytest.mark.parametrize("spec,overrides,key", [
    (TINY, ["eval.samples_per_prompt=2", "eval.pass_at=[4]"], "eval.pass_at"),  # k > samples
    (TINY, ["eval.samples_per_prompt=4", "eval.pass_at=[2]"], "eval.pass_at"),  # copy_char's reward is not binary
    (TINY, ["eval.every_n_steps=5", "checkpoint.keep_best=eval/pass@1"], "checkpoint.keep_best"),  # not logged
    (TINY, ["eval.every_n_steps=0", "checkpoint.keep_best=eval/mean@1"], "checkpoint.keep_best"),  # no eval in training
    (TINY, ["eval.every_n_steps=3", "sync.every_n_steps=2"], "eval.every_n_steps"),  # would score stale weights
    (TINY, ["eval.at_end=true", "eval.data_path=examples/data/letters.parquet"], "eval.data_path"),
    (DATASET, ["eval.at_end=true"], "eval.holdout_records"),  # would score the training records
    (DATASET, ["eval.at_end=true", "eval.split=test"], "eval.split"),  # one file, one split
    (DATASET, ["eval.at_end=true", "eval.data_path=missing.jsonl"], "eval.data_path"),
    (DATASET, ["eval.at_end=true", "eval.holdout_records=8", "eval.source_column=nope"], "eval.source_column"),
    (DATASET, ["eval.at_end=true", "eval.holdout_records=8", "eval.reward=examples/rewards/letters.py:nope"],
     "eval.reward"),
])
def test_bad_eval_input_names_the_key(spec, overrides, key):
    with pytest.raises(SpecError) as err:
        build_plan(spec, overrides, full=False)
    assert err.value.where == key, str(err.value)


def test_eval_sets_copy_char_every_letter_and_held_out_records():
    from rlspec.evaluation import build_eval_set

    plan, _ = build_plan(TINY, ["eval.at_end=true"], full=False)
    assert [p.text for p in build_eval_set(plan.spec).prompts] == ["a=", "b=", "c=", "d="]
    plan, task = build_plan(DATASET, ["eval.at_end=true", "eval.holdout_records=5", "eval.samples_per_prompt=3"])
    held = build_eval_set(plan.spec)
    assert len(held.prompts) == 5 and held.k == 3 and not held.greedy and held.pass_ks == []
    trained = {p.text for step in range(50) for p in task.sample(step, 8)}
    assert trained and not trained & {p.text for p in held.prompts}  # training never draws a held-out record
    _, everything = build_plan(DATASET)
    assert len({p.text for step in range(50) for p in everything.sample(step, 8)}) == len(trained) + 5


def test_run_with_eval_trains_bit_identically_and_rlspec_eval_reproduces_it(tmp_path):
    """Eval before training and every 2 steps, checkpoints kept by eval/mean@1: every training number equals the run
    without eval, and `rlspec eval` on the final checkpoint scores what the run's last eval did, sample by sample."""
    from rlspec.evaluation.command import evaluate
    from rlspec.run import run

    common = ["algorithm.steps=4", "checkpoint.every_n_steps=0", "checkpoint.keep_last=1"]
    run(TINY, [*common, "eval.every_n_steps=0", "eval.before_train=false"], out=str(tmp_path / "plain"), progress=False)
    run(TINY, [*common, "eval.every_n_steps=2", "eval.before_train=true", "checkpoint.keep_best=eval/mean@1"],
        out=str(tmp_path / "eval"), progress=False)
    plain = read_metrics(tmp_path / "plain" / "metrics.jsonl")
    evaluated = read_metrics(tmp_path / "eval" / "metrics.jsonl")
    assert evaluated[0]["step"] == -1 and "eval/mean@1" in evaluated[0]
    assert [r["step"] for r in evaluated if "eval/mean@1" in r] == [-1, 1, 3]
    training = [{k: v for k, v in r.items() if not k.startswith(TRAINING_ONLY)} for r in evaluated[1:]]
    assert training == [{k: v for k, v in r.items() if not k.startswith(TRAINING_ONLY)} for r in plain]
    assert sorted(p.name for p in (tmp_path / "eval" / "eval").iterdir()) == \
        ["initial.jsonl", "step_000001.jsonl", "step_000003.jsonl"]
    best = json.loads((tmp_path / "eval" / "checkpoints" / "best.json").read_text())
    assert best["metric"] == "eval/mean@1" and set(best["scores"]) == {"1", "3"}
    for name in best["best"]:  # the best one survives keep_last=1 beside the last
        assert (tmp_path / "eval" / "checkpoints" / name / "model.safetensors").is_file()

    final = tmp_path / "eval" / "checkpoints" / "step_000003"
    out = evaluate(TINY, [], checkpoints=[str(final)], out=str(tmp_path / "e"))
    result = json.loads((out / "eval.json").read_text())["results"][0]
    assert result["step"] == 3
    assert {k: v for k, v in result["metrics"].items() if k.startswith("eval/")} == \
        {k: v for k, v in evaluated[-1].items() if k.startswith("eval/")}
    completions = [json.loads(line)["completion"] for line in (out / "step_000003.jsonl").read_text().splitlines()]
    ran = [json.loads(line)["completion"]
           for line in (tmp_path / "eval" / "eval" / "step_000003.jsonl").read_text().splitlines()]
    assert completions == ran
    _check_sweeps(tmp_path, final, tmp_path / "plain" / "checkpoints" / "step_000003", evaluated[-1])


def _check_sweeps(tmp_path, final, plain, last_row):
    """`rlspec eval -m`: each checkpoint (`--checkpoint a,b`, a sweep axis) with each swept spec value, in one table
    and one eval.json; `--checkpoints` of a sweep's OUT scores each job's checkpoints with that job's overrides; a bad
    value in any combination exits 2 with nothing written."""
    import shutil

    from rlspec.cli import main

    logged = {k: v for k, v in last_row.items() if k.startswith("eval/")}
    assert main(["eval", TINY, "-m", "eval.max_prompts=4,2", "--checkpoint", f"{plain},{final}",
                 "--out", str(tmp_path / "m")]) == 0
    results = json.loads((tmp_path / "m" / "eval.json").read_text())["results"]
    assert [(r["swept"], r["target"]) for r in results] == [
        (["eval.max_prompts=4"], str(plain)), (["eval.max_prompts=4"], str(final)),
        (["eval.max_prompts=2"], str(plain)), (["eval.max_prompts=2"], str(final))]
    for r in results[:2]:  # the plain run's weights are the evaluated run's: the same scores
        assert {k: v for k, v in r["metrics"].items() if k.startswith("eval/")} == logged
    assert [r["metrics"]["eval/num_prompts"] for r in results] == [4, 4, 2, 2]
    assert (tmp_path / "m" / "1" / "eval_step_000003.jsonl").is_file()

    sweep = tmp_path / "sweep"  # what `rlspec run -m` leaves: OUT/sweep.json, OUT/<n>/overrides.json and checkpoints
    for job, overrides in enumerate([["algorithm.lr=1e-3"], ["eval.max_prompts=1"]]):
        shutil.copytree(final, sweep / str(job) / "checkpoints" / final.name)
        (sweep / str(job) / "overrides.json").write_text(json.dumps(overrides))
    (sweep / "sweep.json").write_text("{}")
    assert main(["eval", TINY, "--checkpoints", str(sweep), "--out", str(tmp_path / "s")]) == 0
    results = json.loads((tmp_path / "s" / "eval.json").read_text())["results"]
    assert [r["overrides"] for r in results] == [["algorithm.lr=1e-3"], ["eval.max_prompts=1"]]
    assert [r["metrics"]["eval/num_prompts"] for r in results] == [4, 1]

    for bad, key in [(["-m", "eval.max_prompts=2,-1", "--checkpoint", str(final)], "eval.max_prompts"),
                     (["-m", "--checkpoint", f"{final},no/such/step_000001"], "--checkpoint"),
                     (["-m", "eval.max_prompts=range(", "--checkpoint", str(final)], "-m")]:
        assert main(["eval", TINY, *bad, "--out", str(tmp_path / "bad")]) == 2, bad
        assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("args,key", [([], "--checkpoint"), (["--checkpoint", "no/such/step_000001"], "--checkpoint"),
                                      (["--checkpoints", "."], "--checkpoints"),
                                      (["--model", "m", "--checkpoint", "c"], "--checkpoint")])
def test_rlspec_eval_bad_targets_exit_2_naming_the_flag(args, key, capsys, tmp_path):
    from rlspec.cli import main

    assert main(["eval", TINY, *args, "--out", str(tmp_path / "o")]) == 2
    assert f"rlspec: error: {key}:" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_eval_keeps_the_engine_weights_that_the_train_phase_frees():
    """rollout.free_during_train=kv_cache_and_weights frees the engine's weights after the step's rollout; an eval
    between the push and the next rollout must not (the next rollout would find none)."""
    from rlspec.evaluation.runner import generate
    from rlspec.models.factory import load_model, load_tokenizer
    from rlspec.rollout.hf import HFEngine
    from rlspec.spec import ModelSpec, RolloutSpec

    rollout = RolloutSpec(max_new_tokens=4)
    engine = HFEngine(load_model(ModelSpec(), 0).eval(), load_tokenizer(ModelSpec()), rollout, "cpu",
                      free_during_train="kv_cache_and_weights", own_process=True)
    generate(engine, ["a=", "b="], 2, 7, greedy=False)
    generate(engine, ["a="], 1, 7, greedy=True)
    engine.generate(["a="], 2, 0)  # the step's rollout: weights freed after it
    with pytest.raises(RuntimeError, match="freed"):
        generate(engine, ["a="], 1, 7, greedy=True)
