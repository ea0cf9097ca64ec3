"""`rlspec.core.weights.gather_groups`: the unit a sharded trainer gathers at once during an export."""

from __future__ import annotations

import torch

from rlspec.core.weights import gather_groups


def test_groups_keep_order_stay_under_the_limit_and_a_large_tensor_goes_alone():
    named = [("a", torch.zeros(3)), ("b", torch.zeros(4)), ("big", torch.zeros(20)), ("c", torch.zeros(2)),
             ("d", torch.zeros(8))]
    groups = list(gather_groups(named, limit_bytes=10 * 4, nbytes=lambda t: t.numel() * 4))
    assert [[name for name, _ in g] for g in groups] == [["a", "b"], ["big"], ["c", "d"]]
    assert [name for g in groups for name, _ in g] == [name for name, _ in named]
    assert list(gather_groups([], 40, lambda t: 0)) == []
    # sized by what the gather will produce, not by the local shard (a ZeRO-3 parameter's numel is 0)
    sized = list(gather_groups(named, limit_bytes=40, nbytes=lambda t: 40))
    assert [len(g) for g in sized] == [1] * len(named)
