"""`algorithm.micro_batch_tokens` on 2 Ray ranks (fsdp, deepspeed): sequences balanced by real tokens, unequal
micro-batch counts evened with placeholders, the same steps as the single-process row-count trainer.

Slow (a Ray rank group per backend); the split and its gradients are checked in CI by `tests/test_packing.py`
on simulated ranks."""

from __future__ import annotations

import pytest

from rlspec.core.backend import all_caps, create_backend
from rlspec.spec import compile_plan, load_spec
from tests.backends.ranks import TINY, assert_same_steps, fixed_batch, reference_trainer, run_steps

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("backend_name", ["fsdp", "deepspeed"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_on_two_ranks_matches_row_count_reference(ray_session, backend_name, loss_agg):
    pytest.importorskip("deepspeed") if backend_name == "deepspeed" else None
    common = ["rollout.prompts_per_step=1", "algorithm.max_grad_norm=0", "algorithm.optimizer=sgd",
              "algorithm.lr=1e-1", f"algorithm.loss_agg={loss_agg}", "algorithm.micro_batch_size=2"]
    reference_plan = compile_plan(load_spec(TINY, common, "standalone"), all_caps())
    # lengths 13 12 13 11 6 7 6 8: rank 0 gets 13 12 7 6 (38 tokens), rank 1 13 11 8 6 (38); a budget of 13
    # packs rank 0 as [13] [12] [7 6] and rank 1 as [13] [11] [8] [6]: rank 0 adds a placeholder
    plan = compile_plan(load_spec(TINY, [*common, "hardware.num_trainer_ranks=2", "algorithm.micro_batch_tokens=13"],
                                  backend_name), all_caps())
    batch = fixed_batch()
    shards = batch.token_shards(2, 13)
    assert [sizes for _, sizes in shards] == [[1, 1, 2, 0], [1, 1, 1, 1]]
    reference = reference_trainer(reference_plan)
    expected = run_steps(reference, reference_plan, batch)
    backend = create_backend(backend_name)
    try:
        backend.setup(plan)
        got = run_steps(backend, plan, batch)
        assert_same_steps(expected, got, backend, reference)
    finally:
        backend.shutdown()
