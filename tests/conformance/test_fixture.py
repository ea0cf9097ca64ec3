"""The fixture and the cases exercise what they claim to."""

from __future__ import annotations

import torch

from rlspec.conformance import CASES, build_fixture, case_spec
from rlspec.spec import BackendCaps, compile_plan


def test_ranks_get_unequal_completion_tokens() -> None:
    batch = build_fixture().train_batch(case_spec(CASES[0], "standalone", 1).algorithm)
    rank0, rank1 = (int(batch.shard(r, 2).loss_mask.sum()) for r in range(2))
    assert rank0 >= 3 * rank1 > 0
    assert torch.all(batch.advantages != 0)
    # right-padded: every row is real tokens then padding
    mask = batch.attention_mask
    assert torch.equal(mask, mask.cummin(dim=1).values)


def test_every_case_compiles_on_two_ranks_and_some_accumulate() -> None:
    caps = {"two_ranks": BackendCaps(name="two_ranks", model_kinds=("causal_lm", "vla"), supports_lora=True)}
    plans = [compile_plan(case_spec(c, "two_ranks", 2), caps) for c in CASES]
    assert all(p.batch.num_trainer_ranks == 2 for p in plans)
    assert any(p.batch.grad_accum_steps > 1 for p in plans)
    assert all(p.spec.algorithm.steps >= 3 for p in plans)
    aggs = {p.spec.algorithm.loss_agg for p in plans}
    assert aggs == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"}
    assert {p.spec.algorithm.optimizer for p in plans} == {"adamw", "sgd"}
    assert {p.needs_reference_model for p in plans} == {True, False}


def test_every_tolerance_states_its_reason() -> None:
    from rlspec.conformance import TOLERANCES

    assert {"loss", "grad_norm", "kl", "weights/adamw", "weights/sgd", "sync/logprobs"} <= set(TOLERANCES)
    for name, tol in TOLERANCES.items():
        assert tol.atol > 0 and tol.rtol >= 0 and len(tol.reason) > 40, name
