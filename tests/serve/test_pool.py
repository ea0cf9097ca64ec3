"""The serving pool's prefill on its own (CPU, fp32): prompts of different widths in one forward — right-padded, or
one after another in one row (`packed`, as CUDA prefills an admission) — give each prompt the K/V and last hidden
it gets alone, and rows admitted from a packed prefill decode as rows prefilled alone do."""

from __future__ import annotations

import pytest
import torch

PROMPTS = [(5, 9, 13), (7, 8, 9, 10, 11), (3, 4, 6, 2)]


@pytest.fixture(scope="module")
def sampler():
    from rlspec.models.factory import load_model
    from rlspec.rollout.static import GraphSampler
    from rlspec.spec import ModelSpec

    model = load_model(ModelSpec(dtype="float32"), 0).eval().requires_grad_(False)
    return GraphSampler(model, torch.device("cpu"))


def pool_of(sampler, packed=False):
    from rlspec.serve.pool import ServingPool

    pool = ServingPool(sampler, 64, 8, eos=0)
    pool.prefills.packed = packed
    return pool


def one_batch(pool):
    batches = {id(b): b for b, _ in (pool.prefills.cache[p] for p in PROMPTS)}
    assert len(batches) == 1, "one forward"
    return next(iter(batches.values()))


def assert_as_alone(sampler, together):
    batch = one_batch(together)
    for p in PROMPTS:
        alone = pool_of(sampler)
        alone.prefills.prefill([list(p)])
        own, _ = alone.prefills.cache[p]
        _, row = together.prefills.cache[p]
        assert batch.widths[row] == len(p) and own.starts == [0]
        torch.testing.assert_close(batch.hidden[row], own.hidden[0], rtol=1e-5, atol=1e-5)
        start = batch.starts[row]
        torch.testing.assert_close(batch.stack[:, :, start:start + len(p)], own.stack, rtol=1e-5, atol=1e-5)
    # each row's hidden is its own last token's, not the padding's or the next prompt's
    assert not torch.allclose(batch.hidden[0], batch.hidden[1])


def test_prompts_of_different_widths_prefill_padded_together_as_alone(sampler):
    together = pool_of(sampler)
    together.prefills.padded(PROMPTS)
    assert one_batch(together).tokens == 3 * 5, "padded to the longest prompt"
    assert_as_alone(sampler, together)


def test_prompts_prefill_packed_in_one_row_as_alone(sampler):
    """The packed forward on CPU attends under the block-diagonal causal mask (CUDA: the varlen kernel)."""
    together = pool_of(sampler, packed=True)
    together.prefills.prefill([list(p) for p in PROMPTS] + [list(PROMPTS[0])])
    batch = one_batch(together)
    assert batch.tokens == 3 + 5 + 4 and batch.starts == [0, 3, 8], "one after another, no padding, once each"
    assert_as_alone(sampler, together)


def test_rows_admitted_from_a_packed_prefill_decode_as_rows_prefilled_alone(sampler):
    """The admission's copy from a packed batch (each row from its prompt's start) and its decode: the same
    tokens as rows whose prompts were prefilled alone, log-probs within fp32 rounding."""
    from rlspec.serve.pool import RowSampling

    rows = [(i, list(p), RowSampling(key=100 + i, max_tokens=6)) for i, p in enumerate(PROMPTS + [PROMPTS[1]])]
    results = []
    for packed in (False, True):
        pool = pool_of(sampler, packed=packed)
        pool.admit(rows)
        got = {}
        while pool.live:
            for d in pool.run():
                tokens, logps = got.setdefault(d.row_id, ([], []))
                tokens += d.tokens
                logps += d.logprobs
        results.append(got)
    alone, packed = results
    assert set(alone) == set(packed) == {0, 1, 2, 3}
    for row in alone:
        assert packed[row][0] == alone[row][0], row
        assert len(alone[row][0]) == 6
        torch.testing.assert_close(torch.tensor(packed[row][1]), torch.tensor(alone[row][1]), rtol=1e-4, atol=1e-5)


def test_the_prefill_attention_kernels_are_a_valid_choice():
    """The kernels a CUDA prefill is restricted to (`decoder.PREFILL_ATTENTION`, cuDNN's left out) as
    `sdpa_kernel` takes them; on CPU its SDPA gives the same under them as unrestricted."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from rlspec.rollout.decoder import PREFILL_ATTENTION

    q, k, v = torch.randn(3, 2, 2, 5, 8).unbind(0)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    with sdpa_kernel(PREFILL_ATTENTION):
        restricted = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(restricted, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("live", [(), (1, 4), (0, 2, 4, 6)])
def test_an_admission_writes_its_rows_with_few_calls_as_with_a_store_per_tensor(sampler, monkeypatch, live):
    """An admission writes its rows' K/V, hidden states and settings with one `_foreach_copy_` over runs of
    consecutive free slots (live rows between them: 1, 3 or 5 runs); the pool's every per-slot tensor ends up as
    with an indexed store per tensor (`FOREACH_RUNS` 0), from a packed batch (rows from their prompts' starts)."""
    from rlspec.serve import pool as pool_module
    from rlspec.serve.pool import RowSampling

    def admitted(runs: int):
        monkeypatch.setattr(pool_module, "FOREACH_RUNS", runs)
        pool = pool_of(sampler, packed=True)
        pool.admit([(100 + b, [40 + b, 41, 42], RowSampling(key=b, max_tokens=4)) for b in range(8)])
        pool.release([b for b in range(8) if b not in live])
        calls = []
        foreach = torch._foreach_copy_
        monkeypatch.setattr(torch, "_foreach_copy_", lambda *a: calls.append(1) or foreach(*a))
        pool.admit([(i, list(p), RowSampling(key=7 + i, max_tokens=5 + i, temperature=0.5 + i, top_p=0.9,
                                             greedy=i == 1, top_logprobs=2 * (i == 2)))
                    for i, p in enumerate(PROMPTS + [PROMPTS[1], (9, 9)])][:8 - len(live)])
        monkeypatch.setattr(torch, "_foreach_copy_", foreach)
        return pool, calls

    few, calls = admitted(16)
    many, none = admitted(0)
    assert len(calls) == 2 and not none  # one for the prompts (one prefill batch), one for the settings
    for name in (*few.PER_ROW, "keys", "values"):
        ours, theirs = getattr(few._pool, name), getattr(many._pool, name)
        for a, b in zip(ours if isinstance(ours, list) else [ours], theirs if isinstance(theirs, list) else [theirs]):
            assert torch.equal(a, b), name
    assert few.live == many.live
