"""Packed sequences and the token-budget split: the same log-probs and the same gradients as the padded,
row-count path (fp32, CPU)."""

from __future__ import annotations


import pytest
import torch

from rlspec.core.batch import TrainBatch
from rlspec.core.grpo import LOSS_AGGS, LossConfig, LossNorm, policy_loss
from rlspec.core.packing import chunk_sizes, pack_all, plan_split
from rlspec.core.policy import accumulate, packs, sequence_logprobs
from rlspec.models.factory import load_model
from rlspec.spec import ModelSpec

LENGTHS = [9, 3, 12, 1, 6, 2, 10, 4]  # ragged, one sequence of a single token


def ragged_batch(lengths=LENGTHS, seed=0):
    """A right-padded batch of `lengths` and a source of small log-prob perturbations."""
    g = torch.Generator().manual_seed(seed)
    n, width = len(lengths), max(lengths) + 2  # two columns of padding in every row
    ids = torch.randint(3, 250, (n, width), generator=g)
    attention = torch.tensor([[1] * k + [0] * (width - k) for k in lengths])
    loss_mask = attention.float()
    loss_mask[:, :2] = 0.0  # a two-token prompt
    loss_mask[5] = 0.0  # a dropped sample: no loss tokens
    noise = lambda: (torch.rand(n, width, generator=g) - 0.5) * 0.2  # noqa: E731
    return TrainBatch(input_ids=ids, attention_mask=attention, loss_mask=loss_mask,
                      advantages=torch.randn(n, generator=g), rewards=torch.zeros(n),
                      old_logprobs=None, ref_logprobs=None, engine_logprobs=None), noise


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_packed_logprobs_equal_padded(impl):
    model = load_model(ModelSpec(attn_implementation=impl), seed=0)
    batch, _ = ragged_batch()
    assert packs(model, batch)
    (packing,) = pack_all([batch.attention_mask], "cpu")
    assert packing.gather(batch.input_ids).shape == (1, sum(LENGTHS))
    with torch.no_grad():
        padded, padded_entropy = sequence_logprobs(model, batch, 0.7)
        packed, packed_entropy = sequence_logprobs(model, batch, 0.7, packing)
    real = batch.attention_mask.bool()
    real[:, 0] = False  # column 0 has no prefix: 0 in both
    torch.testing.assert_close(packed[real], padded[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_entropy[real], padded_entropy[real], rtol=0, atol=1e-5)
    assert not packed[~real].any() and not padded[:, 0].any()
    # The packing is what keeps the sequences apart: one row with positions that do not restart differs.
    ids = packing.gather(batch.input_ids)
    plain = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
    assert (plain.log_softmax(-1)[0, 20, ids[0, 21]] - packed.reshape(-1)[packing.index[21]]).abs() > 1e-3


def test_plan_split_balances_ranks_and_respects_the_budget():
    lengths = [300, 20, 150, 150, 5, 512, 40, 40, 64, 90, 12, 700]
    budget = 512
    plans = plan_split(lengths, 2, budget)
    assert sorted(r for rows, _ in plans for r in rows) == list(range(len(lengths)))
    tokens = [sum(lengths[r] for r in rows) for rows, _ in plans]
    assert max(tokens) - min(tokens) <= max(lengths)  # greedy by length: off by at most one sequence
    assert len({len(sizes) for _, sizes in plans}) == 1  # as many forwards on every rank
    for rows, sizes in plans:
        start = 0
        for size in sizes:
            part = [lengths[r] for r in rows[start:start + size]]
            assert size == 0 or sum(part) <= budget or len(part) == 1  # an over-long sequence is alone
            start += size
        assert start == len(rows)
    assert plan_split([5, 5, 5, 100], 2, 1000)[1] == ([0, 1, 2], [3])  # rank 0 gets the 100, rank 1 the rest
    assert plan_split([100, 1, 1], 2, 50) == [([0], [1]), ([1, 2], [2])]
    assert plan_split([100, 60, 1], 2, 50)[1] == ([1, 2], [1, 1])  # 60 > budget: alone; 1 no longer fits beside it
    # rank 1 has one micro-batch to rank 0's two: a placeholder (size 0) evens the count
    assert plan_split([1, 100, 100], 2, 100) == [([1, 0], [1, 1]), ([2], [1, 0])]
    assert chunk_sizes(7, 3) == [3, 3, 1]


def test_plan_split_evens_out_the_micro_batches():
    # first-fit decreasing needs 3 micro-batches (8, 9 and 3 tokens); dealt again they hold 7, 7 and 6
    assert plan_split([4, 4, 3, 3, 3, 3], 1, 10) == [([0, 4, 1, 5, 2, 3], [2, 2, 2])]
    # uniform rows: no small remainder (four of 59 rows and one of 20 under first-fit)
    assert plan_split([276] * 256, 1, 16384)[0][1] == [52, 51, 51, 51, 51]
    # dealt again, one would hold 10 > 9 tokens: first-fit's own micro-batches stay
    assert plan_split([5, 4, 3, 3, 3], 1, 9) == [([0, 1, 2, 3, 4], [2, 3])]


def _reference_grads(model, batch, norm, cfg):
    """One forward of the whole batch on the padded path: the definition."""
    model.zero_grad(set_to_none=True)
    logp, _ = sequence_logprobs(model, batch, 1.0)
    loss, _ = policy_loss(logp, batch.old_logprobs, batch.advantages, batch.loss_mask, norm, cfg,
                          batch.ref_logprobs, batch.engine_logprobs)
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _split_grads(model, parts, norm, cfg, world_size=1):
    """`accumulate` over each (shard, sizes) part, gradients summed as an all-reduce would."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for shard, sizes in parts:
        stats = accumulate(model, shard, 4, norm, cfg, 1.0, lambda loss: loss.backward(), "cpu", sizes)
        total += stats["loss"]
    return total, {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_gradients_do_not_depend_on_the_split(agg):
    """Packed micro-batches of all, half and 1 row, a placeholder, a token budget, and two ranks (by tokens, and
    the row-count split of 4-row micro-batches): the gradient of the padded
    single forward, for every `loss_agg` (clip, dual-clip, k3 KL and TIS all active)."""
    model = load_model(ModelSpec(), seed=0)
    batch, noise = ragged_batch(seed=1)
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, batch, 1.0)
    batch.old_logprobs = logp + noise()  # ratios off 1, so the clip binds on some tokens
    batch.ref_logprobs = logp + noise()
    batch.engine_logprobs = (logp + noise()) * batch.loss_mask
    cfg = LossConfig(loss_agg=agg, kl_coef=0.1, dual_clip_c=3.0, tis_cap=1.05, clip_eps_low=0.05, clip_eps_high=0.05)
    norm = LossNorm.of(batch.loss_mask, 16)
    want_loss, want = _reference_grads(model, batch, norm, cfg)
    n = len(batch)
    splits = {
        "1 micro-batch": [(batch, [n])],
        "2 micro-batches": [(batch, [n // 2, n - n // 2])],
        "N micro-batches": [(batch, [1] * n)],
        "with a placeholder": [(batch, [3, 0, n - 3])],
        "token budget 16": batch.token_shards(1, 16),
        "2 ranks, budget 16": batch.token_shards(2, 16),
        "2 ranks, row split": [(batch.shard(r, 2), None) for r in range(2)],
    }
    for name, parts in splits.items():
        loss, got = _split_grads(model, parts, norm, cfg)
        assert loss == pytest.approx(want_loss, abs=1e-6), name
        for key, grad in want.items():
            torch.testing.assert_close(got[key], grad, rtol=0, atol=1e-6, msg=f"{name}: {key}")


def test_packed_sdpa_switch_leaves_unpacked_forwards_alone():
    """An sdpa model switched to the packed dispatcher gives the padded path exactly what sdpa gave."""
    from rlspec.core.packing import PACKED_SDPA

    model = load_model(ModelSpec(attn_implementation="sdpa"), seed=0)
    batch, _ = ragged_batch()
    with torch.no_grad():
        before, _ = sequence_logprobs(model, batch, 1.0)
        sequence_logprobs(model, batch, 1.0, pack_all([batch.attention_mask], "cpu")[0])
        assert model.config._attn_implementation == PACKED_SDPA
        after, _ = sequence_logprobs(model, batch, 1.0)
    assert torch.equal(before, after)


@pytest.mark.gpu
def test_packed_bf16_on_cuda_is_as_close_to_fp32_as_padded(monkeypatch):
    """On CUDA an sdpa model's packed forward runs torch's varlen flash kernel: its bf16 log-probs and
    gradients are as close to the fp32 padded reference as the bf16 padded path's are."""
    import rlspec.core.packing as packing_module

    calls = []
    found = packing_module._varlen()
    assert found is not None, "this torch has no torch.nn.attention.varlen"
    varlen, *spelling = found

    def counted(*args, **kwargs):
        calls.append(1)
        return varlen(*args, **kwargs)

    monkeypatch.setattr(packing_module, "_varlen", lambda: (counted, *spelling))
    batch, _ = ragged_batch([40, 7, 130, 1, 64, 90, 3, 128], seed=2)
    batch = batch.to("cuda")
    real = batch.attention_mask.bool()
    real[:, 0] = False
    results = {}
    for name, dtype, packed in (("ref", torch.float32, False), ("padded", torch.bfloat16, False),
                                ("packed", torch.bfloat16, True)):
        model = load_model(ModelSpec(attn_implementation="sdpa", dtype="float32"), seed=0).to("cuda", dtype)
        packing = pack_all([batch.attention_mask.cpu()], "cuda")[0] if packed else None
        logp, _ = sequence_logprobs(model, batch, 1.0, packing)
        (logp * batch.loss_mask).sum().backward()
        results[name] = (logp.float()[real], model.lm_head.weight.grad.float())
    assert calls, "the packed forward did not run the varlen kernel"
    ref_logp, ref_grad = results["ref"]
    for part in (0, 1):
        padded_err = (results["padded"][part] - (ref_logp, ref_grad)[part]).abs().max()
        packed_err = (results["packed"][part] - (ref_logp, ref_grad)[part]).abs().max()
        assert packed_err <= 2 * padded_err + 1e-3, (part, float(packed_err), float(padded_err))


@pytest.mark.gpu
def test_grouped_query_heads_in_the_flash_kernel_equal_repeated_keys():
    """Inference attends with the flash kernel's own grouped-query heads (`packing.varlen_causal`, where torch's
    varlen_attn takes none): the same output as the keys repeated per query head, for prefills and for extensions
    (queries the last of their keys)."""
    from rlspec.core import packing as packing_module

    assert packing_module._flash_forward() is not None
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 14, 2, 64

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)

    for q_lengths, k_lengths in (([40, 7, 130], None), ([50, 3, 64], [2162, 30, 500])):
        k_lengths = k_lengths or q_lengths
        offsets = torch.tensor([0, *torch.tensor(q_lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        k_offsets = torch.tensor([0, *torch.tensor(k_lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = rand(sum(q_lengths), heads, dim)
        k, v = rand(sum(k_lengths), kv_heads, dim), rand(sum(k_lengths), kv_heads, dim)
        with torch.no_grad():
            grouped = packing_module.varlen_causal(q, k, v, offsets, max(q_lengths), 0.125, k_offsets, max(k_lengths))
        repeated = [t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v)]
        with torch.no_grad():
            reference = packing_module.varlen_causal(q, *repeated, offsets, max(q_lengths), 0.125, k_offsets,
                                                     max(k_lengths))
        assert torch.equal(grouped, reference) or (grouped.float() - reference.float()).abs().max() < 1e-2
