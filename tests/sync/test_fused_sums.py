"""`sync.fused_sums` (skipped without CUDA and Triton): the one-launch byte checksums equal the per-tensor
reductions bit for bit, whatever the sizes (blocks, rows of WEIGHT_PERIOD words, tails), inside one flat buffer or
not, beside tensors it does not take; and a captured graph replays them."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _tensors(gen: torch.Generator) -> list[torch.Tensor]:
    from rlspec.sync.base import WEIGHT_PERIOD
    from rlspec.sync.fused_sums import BLOCK

    words = [1, 3, BLOCK - 1, BLOCK, BLOCK + 1, WEIGHT_PERIOD + 5, 3 * WEIGHT_PERIOD + BLOCK + 7]
    out = [torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device="cuda", generator=gen) for n in words]
    out.append(torch.randn(40, 2 * BLOCK + 3, device="cuda", generator=gen).to(torch.bfloat16))  # 2-D, bf16
    flat = torch.randn(6 * BLOCK, device="cuda", generator=gen)  # views side by side in one buffer
    out += [flat[:BLOCK + 2].view(2, -1), flat[BLOCK + 2:4 * BLOCK], flat[4 * BLOCK:]]
    return out


def _one_by_one(tensors: list[torch.Tensor]) -> torch.Tensor:
    from rlspec.sync.base import _weighted, _words

    return torch.stack([_weighted(_words(t.detach().reshape(-1).clone()), torch.int32) for t in tensors])


def test_one_launch_equals_the_per_tensor_sums():
    from rlspec.sync import fused_sums
    from rlspec.sync.base import _fused, checksums, word_views

    if fused_sums.triton is None:
        pytest.skip("no Triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = _tensors(gen)
    assert _fused(tensors, word_views(tensors)) == list(range(len(tensors)))  # the kernel takes them all
    want = _one_by_one(tensors)
    assert torch.equal(checksums(tensors), want)
    # Beside a tensor of bytes (5 bf16: 10 bytes) and one not 4-byte aligned, which the kernel leaves to the
    # per-tensor reductions: all in order
    odd = torch.randn(5, device="cuda", generator=gen).to(torch.bfloat16)
    shifted = torch.randn(9, device="cuda", generator=gen).to(torch.bfloat16)[1:]
    mixed = [tensors[0], odd, tensors[6], shifted, tensors[-1]]
    assert _fused(mixed, word_views(mixed)) == [0, 2, 4]
    assert torch.equal(checksums(mixed), _one_by_one(mixed))
    # One word changed: that tensor's checksum alone changes
    tensors[5][65536 + 2] += 1  # in its second row of WEIGHT_PERIOD words
    after = checksums(tensors)
    changed = (after != want).nonzero().flatten().tolist()
    assert changed == [5] and torch.equal(after, _one_by_one(tensors))


def test_captured_graph_replays_the_one_launch():
    from rlspec.sync import fused_sums
    from rlspec.sync.staging import BucketChecksums

    if fused_sums.triton is None:
        pytest.skip("no Triton")
    gen = torch.Generator(device="cuda").manual_seed(1)
    tensors = _tensors(gen)
    sums = BucketChecksums([tensors[:5], tensors[5:]])
    want = _one_by_one(tensors)
    assert torch.equal(sums(), want) and sums.graphs is not None
    fused_sums._blocks.clear()  # the caches let go; the graphs keep their own tables
    fused_sums._addresses.clear()
    torch.cuda.empty_cache()
    tensors[7].view(-1)[0] += 1
    assert torch.equal(sums(), _one_by_one(tensors)) and not torch.equal(sums(), want)
