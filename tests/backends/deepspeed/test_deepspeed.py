"""The deepspeed backend against the single-process reference, its transports, the watchdog, the CLI.

All tests spawn Ray actors (2 ZeRO-3 ranks on gloo + 1 engine) and share one Ray session per module.
"""

from __future__ import annotations

import json
import time

import pytest

from rlspec.conformance.tolerances import TOLERANCES, weights_tolerance
from rlspec.core.backend import all_caps, create_backend
from rlspec.spec import compile_plan, load_spec
from rlspec.sync import build_transport
from tests.backends.ranks import (TINY, assert_rlspec_eval_reproduces, assert_same_training, check_uneven_updates,
                                  fixed_batch, kill_a_rank_mid_run, max_weight_diff, reference_trainer, rlspec_run,
                                  run_steps)

pytestmark = pytest.mark.distributed


def make_plan(*overrides: str):
    spec = load_spec(TINY, ["hardware.num_trainer_ranks=2", "algorithm.max_grad_norm=0", "hardware.deepspeed.zero_stage=3",
                            *overrides], "deepspeed")
    return compile_plan(spec, all_caps())


CASES = {
    # adam_eps=1e-6: with the default 1e-8, the few weights whose gradient is ~1e-8 turn fp32 rounding of
    # the gradient into ~1e-4 weight differences (the same 1.1e-4 without accumulation; the reference
    # alone moves 2.7e-5 between micro-batch sizes 1 and 2), which would hide a real error of that size.
    "adamw_token_mean": ["algorithm.optimizer=adamw", "algorithm.lr=1e-2", "algorithm.micro_batch_size=2",
                         "algorithm.adam_eps=1e-6"],
    "sgd_seq_mean_kl": ["algorithm.optimizer=sgd", "algorithm.lr=1e-1", "algorithm.micro_batch_size=3",
                        "algorithm.loss_agg=seq-mean-token-mean", "algorithm.kl_coef=0.1"],
    "sgd_sum_norm_clip_ckpt": ["algorithm.optimizer=sgd", "algorithm.lr=1e-1", "algorithm.micro_batch_size=4",
                          "algorithm.loss_agg=seq-mean-token-sum-norm", "algorithm.max_grad_norm=0.05",
                          "model.gradient_checkpointing=true"],
}


# In CI: the clipping + checkpointing case (DeepSpeed's own gradient clipping is the known trap); the other two
# overlap the conformance suite's deepspeed cases and run with `pytest -m slow`.
@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c == "sgd_sum_norm_clip_ckpt" else [pytest.mark.slow])
                                  for c in sorted(CASES)])
def test_matches_local_trainer_and_transports(ray_session, case):
    plan = make_plan("rollout.prompts_per_step=1", *CASES[case])
    batch = fixed_batch()
    reference = reference_trainer(plan)
    expected = run_steps(reference, plan, batch)
    backend = create_backend("deepspeed")
    try:
        backend.setup(plan)
        got = run_steps(backend, plan, batch)
        for (l_ref, g_ref, k_ref), (l, g, k) in zip(expected, got):
            assert l == pytest.approx(l_ref, abs=1e-5)
            assert g == pytest.approx(g_ref, rel=1e-4, abs=1e-6)
            assert k == pytest.approx(k_ref, abs=1e-6)
        want = dict(reference.export_weights())
        have = dict(backend.export_weights())
        assert set(have) == set(want) and "lm_head.weight" not in have  # the tied head: once, as the embedding
        diff = max(float((have[n] - want[n]).abs().max()) for n in want)
        print(f"\n{case}: max abs weight diff vs LocalTrainer after 3 steps = {diff:.3g}; "
              f"loss/grad_norm/kl per step {got}")
        worst = sorted(((float((have[n] - want[n]).abs().max()), int(((have[n] - want[n]).abs() > 1e-5).sum()), n)
                        for n in want), reverse=True)[:3]
        print("  worst tensors (max diff, #elements > 1e-5, name):", worst)
        assert diff < (2e-5 if "adamw" in case else 1e-6)
        check_uneven_updates(backend, reference, lambda k: make_plan(
            "rollout.prompts_per_step=4", "algorithm.group_size=4", *CASES[case], "algorithm.micro_batch_size=1",
            f"algorithm.updates_per_batch={k}"))
        # Every transport this backend offers: after a push, the engine scores like the trainer.
        engine = backend.rollout_engine()
        trainer_logp = backend.logprobs(batch)
        for method in ("ray", "nccl", "checkpoint"):
            transport = build_transport(method, plan.spec.sync)
            try:
                transport.connect(engine, backend.weight_source())
                assert transport.push(backend.weight_source(), engine) > 0
            finally:
                transport.close()
            engine_logp = engine.logprobs(batch)
            err = float(((engine_logp - trainer_logp) * batch.loss_mask).abs().max())
            print(f"  {method}: engine vs trainer logprob max abs diff {err:.3g}")
            assert err < 1e-5
    finally:
        backend.shutdown()
        backend.shutdown()  # idempotent


# ZeRO-1 with -m slow: the conformance suite's deepspeed cases step ZeRO-1 (the tiny model's stage) in CI, and
# ZeRO-1's optimizer class is ZeRO-2's (DeepSpeed's stage_1_and_2), whose checkpoints cross here in CI
@pytest.mark.parametrize("stage", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_zero12_steps_like_the_reference_and_checkpoints_cross_backends(ray_session, tmp_path, stage):
    """`hardware.deepspeed.zero_stage=2` (and 1) on 2 ranks (AdamW; clipping at 0.05, which binds; the k1 KL to the
    frozen reference module; 2 micro-batches a rank). The single-process trainer's checkpoint after 2 steps loads
    before ZeRO's first step (its moment fragments are not linked to optimizer state yet); 2 more steps then agree
    with the trainer's within the conformance tolerances. ZeRO's own checkpoint, loaded into a single-process
    trainer, takes the next step as the uninterrupted trainer does: moments, fp32 weights and AdamW's step count all
    made it through both ways (without moments a step moves weights by ~lr = 1e-2)."""
    plan = make_plan("rollout.prompts_per_step=1", "algorithm.optimizer=adamw", "algorithm.lr=1e-2",
                     "algorithm.adam_eps=1e-6", "algorithm.micro_batch_size=2", "algorithm.kl_coef=0.1",
                     "algorithm.kl_estimator=k1", "algorithm.max_grad_norm=0.05",
                     f"hardware.deepspeed.zero_stage={stage}")
    batch = fixed_batch()
    reference = reference_trainer(plan)
    run_steps(reference, plan, batch, steps=2)
    reference.save(tmp_path / "single", save_optimizer=True)
    backend = create_backend("deepspeed")
    try:
        backend.setup(plan)
        backend.load(tmp_path / "single")
        got = run_steps(backend, plan, batch, steps=2)
        backend.save(tmp_path / "zero")
        have = dict(backend.export_weights())
    finally:
        backend.shutdown()
    expected = run_steps(reference, plan, batch, steps=2)
    print(f"\nZeRO-{stage} (loss, grad norm, kl) per step {got}\n  reference {expected}")
    assert all(g > 0.05 for _, g, _ in expected)  # the clipping binds
    for (loss_ref, norm_ref, kl_ref), (loss, norm, kl) in zip(expected, got, strict=True):
        assert abs(loss - loss_ref) <= TOLERANCES["loss"].bound(loss_ref)
        assert abs(norm - norm_ref) <= TOLERANCES["grad_norm"].bound(norm_ref)
        assert abs(kl - kl_ref) <= TOLERANCES["kl"].bound(kl_ref)
    diff = max_weight_diff(have, dict(reference.export_weights()))
    print(f"  max abs weight diff vs the reference after 4 steps: {diff:.3g}")
    assert diff <= weights_tolerance("adamw").atol

    resumed = reference_trainer(plan)
    resumed.load(tmp_path / "zero")
    run_steps(resumed, plan, batch, steps=1)
    run_steps(reference, plan, batch, steps=1)
    diff = max_weight_diff(dict(resumed.export_weights()), dict(reference.export_weights()))
    print(f"  resumed from ZeRO-{stage}'s checkpoint, one more step: max abs weight diff {diff:.3g}")
    assert diff <= weights_tolerance("adamw").atol


def test_zero1_steps_as_zero3_in_bf16_on_two_ranks(ray_session):
    """bf16 on 2 ranks, where DeepSpeed runs ZeRO-1 as its BF16_Optimizer: each gradient added into the rank's fp32
    accumulator by a hook during the backward, the accumulators all-reduced at the boundary (skipped only with one
    rank). AdamW, clipping at 0.05 (it binds), 2 micro-batches a rank, 2 steps from the same weights: the first
    step's loss and grad norm as ZeRO-3's (6.5e-5 apart relative: the two reduce gradients differently), and weights
    after 2 steps far closer to ZeRO-3's than to where they started (1.9% of the distance). With the all-reduce
    skipped each rank steps its partition on its own half of the batch: grad norm 4.97 against 3.26."""
    runs = []
    for stage in (3, 1):
        plan = make_plan("rollout.prompts_per_step=1", "model.dtype=bfloat16", "algorithm.optimizer=adamw",
                         "algorithm.lr=1e-2", "algorithm.micro_batch_size=2", "algorithm.max_grad_norm=0.05",
                         f"hardware.deepspeed.zero_stage={stage}")
        backend = create_backend("deepspeed")
        try:
            backend.setup(plan)
            start = dict(backend.export_weights())
            runs.append((run_steps(backend, plan, fixed_batch(), steps=2), dict(backend.export_weights()), start))
        finally:
            backend.shutdown()
    (want, want_weights, start), (have, have_weights, _) = runs
    def norm(a: dict, b: dict) -> float:  # L2 distance over all weights: AdamW moves a weight by about lr whatever
        return sum(float((a[k].float() - b[k].float()).square().sum()) for k in a) ** 0.5  # its gradient's size

    moved, diff = norm(want_weights, start), norm(have_weights, want_weights)
    print(f"\nZeRO-1 (loss, grad norm, kl) per step {have}\n  ZeRO-3 {want}\n"
          f"  L2 distance to ZeRO-3's weights {diff:.3g}, ZeRO-3's own move {moved:.3g}")
    assert want[0][1] > 0.05
    assert have[0][0] == pytest.approx(want[0][0], abs=1e-5)
    assert have[0][1] == pytest.approx(want[0][1], rel=1e-3)
    assert diff <= 0.1 * moved


def test_cli_run_smoke_and_resume(tmp_path):
    """3 steps through the CLI; then resume from the step-1 checkpoint and land on the same weights. The engine frees
    its weights after each rollout (`rollout.free_during_train=kv_cache_and_weights`): each push restores them."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    args = ("algorithm.steps=3", "checkpoint.every_n_steps=2", "checkpoint.keep_last=0",
            "rollout.free_during_train=kv_cache_and_weights")
    evaluated = ("eval.before_train=true", "eval.every_n_steps=1")
    proc = rlspec_run("deepspeed", tmp_path / "run", *args, *evaluated)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [-1, 0, 1, 2] and all("eval/mean@1" in r for r in rows)
    rows = rows[1:]
    assert all(r["sync/bytes"] > 0 for r in rows)
    final = tmp_path / "run" / "checkpoints" / "step_000002"
    AutoModelForCausalLM.from_pretrained(final)  # save() wrote a loadable HF directory
    assert (final / "optimizer" / "state.safetensors").is_file()  # the portable optimizer state
    assert_rlspec_eval_reproduces(rows[-1], final, tmp_path / "eval")

    shutil.copytree(tmp_path / "run", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_000002")
    proc = rlspec_run("deepspeed", tmp_path / "resumed", *args, "--resume")  # without the evals
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-4000:]
    assert_same_training(rows[-1], tmp_path / "resumed")
    want = load_file(final / "model.safetensors")
    have = load_file(tmp_path / "resumed" / "checkpoints" / "step_000002" / "model.safetensors")
    diff = max(float((have[n] - want[n]).abs().max()) for n in want)
    print(f"\nresume from step 1: max abs weight diff at step 2 vs the uninterrupted run {diff:.3g}")
    assert diff < 1e-6


@pytest.mark.slow  # the shared rank group's watchdog: fsdp's killed-rank test runs the same code in CI
def test_watchdog_killed_rank_stops_run(tmp_path):
    """SIGKILL trainer rank actor mid-run: exit 1 within 30 s, naming the dead rank."""
    returncode, elapsed, err = kill_a_rank_mid_run("deepspeed", "DeepSpeedWorker", tmp_path / "killed")
    assert returncode == 1, err[-4000:]
    assert elapsed < 30
    assert "run failed: trainer rank" in err and "died" in err, err[-4000:]


@pytest.mark.slow  # fsdp's in-process fault test covers a raising rank's traceback in CI
def test_watchdog_raising_rank_reports_traceback(tmp_path):
    """A rank that raises (test hook RLSPEC_FAULT_INJECT) stops the run with its Python traceback."""
    start = time.monotonic()
    proc = rlspec_run("deepspeed", tmp_path / "raised", "algorithm.steps=50", env={"RLSPEC_FAULT_INJECT": "rank=1,step=2,mode=raise"})
    _, err = proc.communicate(timeout=400)
    print(f"\nraising rank: exit {proc.returncode} after {time.monotonic() - start:.1f} s (incl. start-up)")
    assert proc.returncode == 1, err[-4000:]
    assert "trainer rank 1 failed: RuntimeError" in err
    assert "injected fault" in err and "worker.py" in err and "forward_backward" in err  # the worker's traceback
