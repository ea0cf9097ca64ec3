"""Prefix reuse across turns (`rlspec.serve.kv.prefix.PrefixCache`) in the serving pool, CPU fp32: a row's next turn (its
prompt, the tokens it sampled, then a tool result) prefills only the new tokens, and samples the same tokens with
the same log-probs as a fresh prefill of the whole context (bit for bit); the bound, eviction and a weight refresh;
on CUDA the same within bf16 (GPU-marked)."""

from __future__ import annotations

import pytest
import torch

from rlspec.serve.pool import RowSampling, ServingPool
from rlspec.serve.kv.prefix import BLOCK, PrefixCache

PROMPT = [(7 * i) % 200 + 3 for i in range(40)]
TOOL = [(11 * i) % 200 + 3 for i in range(23)]


def sampler_on(device: str, dtype: str):
    from rlspec.models.factory import load_model
    from rlspec.rollout.static import GraphSampler
    from rlspec.spec import ModelSpec

    model = load_model(ModelSpec(dtype=dtype), 0, device).to(device).eval().requires_grad_(False)
    return GraphSampler(model, torch.device(device))


@pytest.fixture(scope="module")
def sampler():
    return sampler_on("cpu", "float32")


def sample(pool: ServingPool, prompts: list[list[int]], key: int = 7, max_tokens: int = 8):
    """Each prompt's (tokens, log-probs), all rows admitted together and run to their end."""
    pool.admit([(i, p, RowSampling(key=key + i, max_tokens=max_tokens)) for i, p in enumerate(prompts)])
    got = {i: ([], []) for i in range(len(prompts))}
    while pool.live:
        for d in pool.run():
            got[d.row_id][0].extend(d.tokens)
            got[d.row_id][1].extend(d.logprobs)
    return [got[i] for i in range(len(prompts))]


def three_turns(pool: ServingPool, first: list[list[int]]):
    """Turn 1 on `first`, then two more turns each on the previous prompt + its tokens + a tool result; every turn's
    (prompt, tokens, log-probs)."""
    turns, prompts = [], first
    for turn in range(3):
        out = sample(pool, prompts, key=100 * turn)
        turns.append([(p, t, lp) for p, (t, lp) in zip(prompts, out)])
        prompts = [p + t + TOOL[:10 + 5 * i] for i, (p, (t, _)) in enumerate(zip(prompts, out))]
    return turns


def assert_reuse_equals_fresh(make_pool, first, rtol, atol):
    reusing, fresh = make_pool(), make_pool()
    fresh.prefills.prefix.max_tokens = 0  # keeps nothing: every turn prefills its whole context
    with_cache, without = three_turns(reusing, first), three_turns(fresh, first)
    stats = reusing.prefills.prefix.stats
    assert stats["hits"] == 2 * len(first) and fresh.prefills.prefix.stats["hits"] == 0
    # each later turn computed only the tool result's tokens (the K/V of every sampled token, the last included, are
    # in the row's slot when it ends)
    assert stats["new_tokens"] == sum(10 + 5 * i for i in range(len(first))) * 2, stats
    for turn_with, turn_without in zip(with_cache, without):
        for (p1, t1, lp1), (p2, t2, lp2) in zip(turn_with, turn_without):
            assert p1 == p2 and t1 == t2  # token-exact trajectories
            torch.testing.assert_close(torch.tensor(lp1), torch.tensor(lp2), rtol=rtol, atol=atol)


def test_a_turn_extending_an_ended_row_prefills_only_its_new_tokens_and_samples_as_a_fresh_prefill(sampler):
    assert_reuse_equals_fresh(lambda: ServingPool(sampler, 256, 8, eos=0), [PROMPT, PROMPT[:33], PROMPT[5:]],
                              rtol=0, atol=0)  # exact: bit for bit


def test_the_extension_forward_gives_a_fresh_prefills_kv_and_hidden(sampler):
    pool = ServingPool(sampler, 256, 8, eos=0)
    (tokens, _), = sample(pool, [PROMPT])
    prompt = tuple(PROMPT + tokens + TOOL)
    pool.prefills.prefill([list(prompt)])
    reused, row = pool.prefills.cache[prompt]
    fresh = ServingPool(sampler, 256, 8, eos=0)
    fresh.prefills.padded([prompt])
    own, _ = fresh.prefills.cache[prompt]
    start = reused.starts[row]
    assert torch.equal(reused.stack[:, :, start:start + len(prompt)], own.stack)
    assert torch.equal(reused.hidden[row], own.hidden[0])


class _Replayed:
    """A captured forward's stand-in on CPU: `replay` runs it again into the first run's output, as a graph does."""

    def __init__(self, forward):
        self.forward = forward
        self.out = forward()

    def replay(self):
        self.out.copy_(self.forward())


def test_the_captured_extension_lays_out_several_turns_as_their_fresh_prefills(sampler, monkeypatch):
    """The packed extension (what CUDA replays from a graph: contexts one after another in one key buffer, new tokens
    one after another, a padding sequence, varlen attention with key offsets), run eagerly on CPU under the mask it
    stands for: each turn's K/V and last hidden equal its fresh prefill's to fp32 rounding, across two forwards (the
    graph's token bound lowered) and rows reusing different lengths."""
    from rlspec.serve.kv import prefill

    monkeypatch.setattr(prefill.Prefills, "_capture", lambda self, forward: ((r := _Replayed(forward)), r.out))
    monkeypatch.setattr(prefill, "PREFILL_GRAPH_TOKENS", 64)
    monkeypatch.setattr(prefill, "PREFILL_GRAPH_MIN", 16)
    pool = ServingPool(sampler, 256, 8, eos=0)
    pool.prefills.packed = True  # the layout CUDA's packed prefills take (here each forward eager, masked)
    first = [PROMPT, PROMPT[:33], PROMPT[5:], PROMPT[::-1]]
    out = sample(pool, first)
    turns = [p + t + TOOL[:7 + 9 * i] for i, (p, (t, _)) in enumerate(zip(first, out))]
    pool.prefills.prefill(turns)
    stats = pool.prefills.prefix.stats
    assert stats["hits"] == stats["captured"] == 4 and stats["declined"] == 0
    # (new tokens, key tokens): 7 + 16 new in 121 keys with the padding, then 25 + 34 in 155
    assert sorted(k[1:] for k in pool.prefills.graphs if isinstance(k, tuple)) == [(32, 128), (64, 256)]
    fresh = ServingPool(sampler, 256, 8, eos=0)
    for p in map(tuple, turns):
        fresh.prefills.padded([p])
        (a, i), (b, _) = pool.prefills.cache[p], fresh.prefills.cache[p]
        torch.testing.assert_close(a.stack[:, :, a.starts[i]:a.starts[i] + len(p)], b.stack, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.hidden[i], b.hidden[0], rtol=1e-5, atol=1e-5)


def test_the_cache_is_bounded_evicts_the_oldest_and_a_weight_refresh_clears_it(sampler):
    pool = ServingPool(sampler, 256, 8, eos=0)
    cache = pool.prefills.prefix
    sample(pool, [PROMPT])
    assert len(cache) == 1 and cache.match(tuple(PROMPT + [5] * 20))[1] >= len(PROMPT)
    pool.refresh_weights()  # a push: K/V of other weights are never reused
    assert len(cache) == 0 and cache.match(tuple(PROMPT + [5] * 20)) == (None, 0)
    # bounded by tokens: the least recently used sequence goes first
    small = PrefixCache(max_tokens=100)
    kv = torch.zeros(4, 1, 64, 2)
    for i in range(3):
        small._add(tuple([i] * 40), kv, 40)
    assert len(small) == 2 and small.tokens == 80 and small.stats["evicted"] == 1
    assert small.match(tuple([0] * 41)) == (None, 0) and small.match(tuple([2] * 41))[1] == 40
    # a prompt shorter than a block, or one that matches no whole block, reuses nothing
    assert small.match(tuple([2] * (BLOCK - 1))) == (None, 0)
    assert small.match(tuple([2] * (BLOCK - 1) + [9] * 30)) == (None, 0)
    assert small.match(tuple([2] * 40 + [9] * 41)) == (None, 0)  # under half the prompt: a fresh prefill


@pytest.mark.gpu
def test_prefix_reuse_on_cuda_agrees_with_a_fresh_prefill_within_bf16():
    """CUDA, bf16, captured decode steps and packed prefills: a turn-2 prompt extended from turn 1's kept K/V (one
    captured extension forward: varlen attention with key offsets) against the same prompt prefilled whole (packed,
    from a graph): K/V and last hidden within bf16 rounding, and the log-probs
    of the tokens both then sample alike (a near tie of a random model may resolve differently in bf16)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sampler = sampler_on("cuda", "bfloat16")
    prompts = [PROMPT * 4, PROMPT[:33] * 3, PROMPT[5:] * 5]
    reusing, fresh = ServingPool(sampler, 1024, 8, eos=0), ServingPool(sampler, 1024, 8, eos=0)
    fresh.prefills.prefix.max_tokens = 0
    first = sample(reusing, prompts, key=0)
    turn = [p + t + TOOL for p, (t, _) in zip(prompts, first)]
    reusing.prefills.prefill(turn)
    fresh.prefills.prefill(turn)
    stats = reusing.prefills.prefix.stats
    assert stats["hits"] == stats["captured"] == 3 and stats["declined"] == 0  # one captured extension forward
    for p in map(tuple, turn):
        (a, i), (b, j) = reusing.prefills.cache[p], fresh.prefills.cache[p]
        kv_a = a.stack[:, :, a.starts[i]:a.starts[i] + len(p)].float()
        kv_b = b.stack[:, :, b.starts[j]:b.starts[j] + len(p)].float()
        torch.testing.assert_close(kv_a, kv_b, rtol=5e-2, atol=5e-2)
        torch.testing.assert_close(a.hidden[i].float(), b.hidden[j].float(), rtol=5e-2, atol=5e-2)
    with_cache, without = sample(reusing, turn, key=100), sample(fresh, turn, key=100)
    for (t1, lp1), (t2, lp2) in zip(with_cache, without):
        same = next((k for k, (x, y) in enumerate(zip(t1, t2)) if x != y), len(t1))
        torch.testing.assert_close(torch.tensor(lp1[:same]), torch.tensor(lp2[:same]), rtol=0, atol=0.1)


@pytest.mark.parametrize("slots", [[3], [5, 1, 2], [0, 6, 2, 4, 7]])
def test_rows_kept_from_runs_of_slots_hold_what_a_gather_per_layer_takes(slots, monkeypatch):
    """`PrefixCache.keep` copies rows that end together with one stack per run of consecutive slots (slices, no
    gather per layer): each kept entry holds its slot's K/V as the gather per layer does (`KEEP_RUNS` 0), in the same
    order of entries (the newest answers for a shared block)."""
    from rlspec.serve.kv import prefix

    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(8, 2, 40, 4, generator=gen) for _ in range(3)]
    values = [torch.randn(8, 2, 40, 4, generator=gen) for _ in range(3)]
    rows = [([1] * BLOCK + [slot] * (3 + slot), slot) for slot in slots]

    def kept(runs: int) -> list:
        monkeypatch.setattr(prefix, "KEEP_RUNS", runs)
        cache = PrefixCache(10_000)
        cache.keep(rows, keys, values)
        return list(cache._entries.values())

    by_runs, by_gather = kept(8), kept(0)
    assert [e.ids for e in by_runs] == [e.ids for e in by_gather] == [tuple(ids) for ids, _ in rows]
    for (ids, slot), a, b in zip(rows, by_runs, by_gather):
        assert torch.equal(a.stack, b.stack)
        assert torch.equal(a.stack[:, :, :len(ids)], torch.stack([t[slot, :, :len(ids)] for t in keys + values]))
