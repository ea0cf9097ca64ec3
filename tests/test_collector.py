"""`rlspec.runtime.collector.collection_paused`: Python's automatic garbage collection off inside the train phase's
micro-batch loops, on again after, and the caller's own setting kept."""

from __future__ import annotations

import gc

import pytest
import torch

from rlspec.core.batch import TrainBatch
from rlspec.core.grpo import LossConfig, LossNorm
from rlspec.core.policy import accumulate
from rlspec.runtime import collector


def test_collection_is_paused_inside_and_restored_after():
    assert gc.isenabled()
    with collector.collection_paused():
        assert not gc.isenabled()
        with collector.collection_paused():  # nested: still off, and the outer exit turns it back on
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    assert collector._frozen and gc.get_freeze_count() > 0  # the first exit froze what was alive


def test_a_caller_that_turned_collection_off_keeps_it_off():
    gc.disable()
    try:
        with collector.collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


class _Seen(Exception):
    """Raised by the test model's forward: enough once the loop has called it."""


def test_the_micro_batch_loop_runs_without_automatic_collection():
    """`accumulate` runs its forwards with automatic collection off, and turns it back on when one raises."""
    seen = []

    class Model(torch.nn.Module):
        def forward(self, input_ids, **_):
            seen.append(gc.isenabled())
            raise _Seen

    batch = TrainBatch(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3, dtype=torch.long),
                       loss_mask=torch.ones(2, 3), advantages=torch.ones(2), rewards=torch.ones(2))
    with pytest.raises(_Seen):
        accumulate(Model(), batch, 1, LossNorm.of(batch.loss_mask, 3), LossConfig(), 1.0, lambda loss: None, "cpu")
    assert seen == [False] and gc.isenabled()
