"""GRPO math against a plain per-token loop, hand-computed cases, and micro-batch invariance."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rlspec.core.grpo import (LossConfig, LossNorm, group_advantages, kept_samples, kl_penalty, policy_loss, token_entropy, token_logprobs, token_logprobs_and_entropy)


def loop_advantages(rewards: list[float], group_size: int, norm: str, eps: float,
                    kept: list[bool] | None = None) -> list[float]:
    out = []
    for g in range(0, len(rewards), group_size):
        members = range(g, g + group_size)
        keep = [i for i in members if kept is None or kept[i]]
        group = [rewards[i] for i in keep]
        mean = sum(group) / max(len(group), 1)
        var = sum((r - mean) ** 2 for r in group) / max(len(group) - 1, 1)
        for i in members:
            if i not in keep:
                out.append(0.0)
                continue
            r = rewards[i]
            out.append((r - mean) / (math.sqrt(var) + eps) if norm == "group_std" else r - mean)
    return out


def loop_loss(logp, old, ref, adv, mask, cfg: LossConfig, max_new_tokens: int, engine=None) -> float:
    """The formulas of rlspec.core.grpo's docstring, one token at a time in plain Python floats."""
    per_seq_sums, per_seq_counts = [], []
    for i in range(len(logp)):
        total, count = 0.0, 0
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            a = adv[i]
            ratio = math.exp(logp[i][t] - old[i][t])
            clipped_ratio = min(max(ratio, 1 - cfg.clip_eps_low), 1 + cfg.clip_eps_high)
            loss = max(-a * ratio, -a * clipped_ratio)
            if cfg.dual_clip_c is not None and a < 0:
                loss = min(loss, -a * cfg.dual_clip_c)
            if engine is not None and cfg.tis_cap is not None:
                loss *= min(math.exp(old[i][t] - engine[i][t]), cfg.tis_cap)
            if cfg.kl_coef > 0:
                d = ref[i][t] - logp[i][t]
                kl = (logp[i][t] - ref[i][t]) if cfg.kl_estimator == "k1" else math.exp(d) - d - 1
                loss += cfg.kl_coef * kl
            total += loss
            count += 1
        per_seq_sums.append(total)
        per_seq_counts.append(count)
    n = sum(1 for c in per_seq_counts if c)  # sequences with completion tokens
    if cfg.loss_agg == "token-mean":
        return sum(per_seq_sums) / sum(per_seq_counts)
    if cfg.loss_agg == "seq-mean-token-mean":
        return sum(s / max(c, 1) for s, c in zip(per_seq_sums, per_seq_counts)) / n
    return sum(per_seq_sums) / (n * max_new_tokens)


def random_case(seed: int, n: int = 6, length: int = 9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, length, generator=g, dtype=torch.float64) * 3
    old = logp + (torch.rand(n, length, generator=g, dtype=torch.float64) - 0.5) * 0.8  # ratios well outside the clip
    ref = logp + (torch.rand(n, length, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.zeros(n, length, dtype=torch.float64)
    for i in range(n):
        start = 2 + i % 3
        mask[i, start:start + 1 + (i * 5) % (length - start)] = 1
    return logp, old, ref, adv, mask


CONFIGS = [LossConfig(loss_agg=agg, kl_coef=kl, kl_estimator=est, dual_clip_c=dual, clip_eps_high=high)
           for agg, (kl, est), dual, high in itertools.product(
               ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
               ((0.0, "k3"), (0.1, "k1"), (0.05, "k3")), (None, 3.0), (0.2, 0.28))]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss_agg}-kl{c.kl_coef}{c.kl_estimator}-dual{c.dual_clip_c}-hi{c.clip_eps_high}")
def test_loss_equals_per_token_loop(cfg):
    logp, old, ref, adv, mask = random_case(seed=7)
    norm = LossNorm.of(mask, max_new_tokens=12)
    loss, stats = policy_loss(logp, old, adv, mask, norm, cfg, ref)
    expected = loop_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), cfg, 12)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    assert stats["tokens"] == mask.sum().item()


def test_advantages_equal_loop_and_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    got = group_advantages(rewards, 4, "group_std", 1e-6)
    assert got.tolist() == pytest.approx(loop_advantages(rewards.tolist(), 4, "group_std", 1e-6), abs=1e-6)
    # group 1: mean 0.5, unbiased std sqrt(1/3); a constant group has zero advantage, not NaN
    assert got[0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-6), rel=1e-6)
    assert got[4:].tolist() == [0.0] * 4
    assert group_advantages(rewards, 4, "none").tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_hand_computed_clip_and_dual_clip():
    mask = torch.tensor([[0.0, 1.0]])
    norm = LossNorm.of(mask, 4)
    # ratio e^{0.5} = 1.6487 with A = +1: clipped at 1.2 -> loss -1.2, the token counts as clipped
    loss, stats = policy_loss(torch.tensor([[0.0, 0.5]]), torch.zeros(1, 2), torch.tensor([1.0]), mask, norm, LossConfig())
    assert loss.item() == pytest.approx(-1.2)
    assert stats["clipped_tokens"] == 1
    # A = -1 with ratio e^{2} = 7.389: PPO gives 7.389; dual-clip with c = 3 caps it at 3
    logp = torch.tensor([[0.0, 2.0]])
    plain, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), mask, norm, LossConfig())
    dual, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), mask, norm, LossConfig(dual_clip_c=3.0))
    assert plain.item() == pytest.approx(math.exp(2.0))
    assert dual.item() == pytest.approx(3.0)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    assert kl_penalty(logp, logp, "k3").item() == 0.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_split_into_micro_batches_and_ranks_sums_to_whole(agg):
    """Global normalisers make the loss and its gradient invariant to how the batch is split."""
    logp, old, ref, adv, mask = random_case(seed=3, n=8)
    cfg = LossConfig(loss_agg=agg, kl_coef=0.1)
    norm = LossNorm.of(mask, 12)
    whole_logp = logp.clone().requires_grad_(True)
    whole, _ = policy_loss(whole_logp, old, adv, mask, norm, cfg, ref)
    whole.backward()
    split_logp = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in ([0, 1, 2], [3], [4, 5, 6, 7]):  # uneven pieces, uneven token counts
        part, _ = policy_loss(split_logp[rows], old[rows], adv[rows], mask[rows], norm, cfg, ref[rows])
        part.backward()
        total += part.item()
    assert total == pytest.approx(whole.item(), rel=1e-12)
    torch.testing.assert_close(split_logp.grad, whole_logp.grad, rtol=0, atol=1e-15)


def test_local_normaliser_is_not_invariant():
    """The bug the global normaliser prevents: per-shard token-mean averaged over shards differs."""
    logp, old, _, adv, mask = random_case(seed=3, n=8)
    cfg = LossConfig()
    whole, _ = policy_loss(logp, old, adv, mask, LossNorm.of(mask, 12), cfg)
    halves = [policy_loss(logp[s], old[s], adv[s], mask[s], LossNorm.of(mask[s], 12), cfg)[0] for s in (slice(0, 4), slice(4, 8))]
    assert abs((halves[0] + halves[1]).item() / 2 - whole.item()) > 1e-3


def test_token_logprobs_alignment():
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    ids = torch.randint(0, 7, (2, 5))
    got = token_logprobs(logits, ids, temperature=0.7)
    assert got[:, 0].tolist() == [0.0, 0.0]
    for b in range(2):
        for t in range(1, 5):
            want = torch.log_softmax(logits[b, t - 1] / 0.7, -1)[ids[b, t]]
            assert got[b, t].item() == pytest.approx(want.item(), rel=1e-12)


TIS_CONFIGS = [LossConfig(loss_agg=agg, kl_coef=kl, dual_clip_c=dual, tis_cap=cap)
               for agg, kl, dual, cap in itertools.product(
                   ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"), (0.0, 0.1), (None, 3.0), (None, 1.5))]


@pytest.mark.parametrize("cfg", TIS_CONFIGS, ids=lambda c: f"{c.loss_agg}-kl{c.kl_coef}-dual{c.dual_clip_c}-tis{c.tis_cap}")
def test_tis_loss_equals_per_token_loop(cfg):
    """Truncated importance sampling against the engine's log-probs, and a dropped (all-masked) row."""
    logp, old, ref, adv, mask = random_case(seed=11)
    g = torch.Generator().manual_seed(5)
    engine = old + (torch.rand(old.shape, generator=g, dtype=torch.float64) - 0.5) * 1.5  # ratios on both sides of the cap
    engine = engine * mask  # the engine has log-probs only on completion tokens
    mask[2] = 0  # a dropped sample: no loss tokens, and not counted as a sequence
    norm = LossNorm.of(mask, max_new_tokens=12)
    assert norm.num_sequences == len(mask) - 1
    loss, stats = policy_loss(logp, old, adv, mask, norm, cfg, ref, engine)
    expected = loop_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), cfg, 12, engine.tolist())
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    ratios = [math.exp(old[i, t] - engine[i, t]) for i in range(len(mask)) for t in range(mask.shape[1]) if mask[i, t]]
    assert stats["is_ratio_sum"] == pytest.approx(sum(ratios), rel=1e-12)
    clipped = sum(r > cfg.tis_cap for r in ratios) if cfg.tis_cap is not None else 0
    assert stats["is_clipped_tokens"] == clipped
    if cfg.tis_cap is not None:
        assert 0 < clipped < len(ratios)  # the case exercises the cap


def test_tis_weight_carries_no_gradient_and_is_inert_on_policy():
    logp, old, _, adv, mask = random_case(seed=2)
    cfg = LossConfig(tis_cap=2.0)
    norm = LossNorm.of(mask, 12)
    plain_logp, tis_logp = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    plain, _ = policy_loss(plain_logp, old, adv, mask, norm, LossConfig())
    on_policy, stats = policy_loss(tis_logp, old, adv, mask, norm, cfg, engine_logp=old)  # engine == pi_old: w = 1
    plain.backward()
    on_policy.backward()
    assert on_policy.item() == plain.item() and stats["is_clipped_tokens"] == 0
    assert torch.equal(tis_logp.grad, plain_logp.grad)


def test_advantages_with_dropped_samples_equal_loop():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 0.5, 0.2, 0.9, float("nan"), float("nan"), 0.3, 0.3, 0.1, 0.7])
    valid = torch.isfinite(rewards)
    kept = kept_samples(valid, 4)
    # group 2 keeps one member only: no baseline, dropped whole
    assert kept.tolist() == [True, False, True, True, True, True, False, False, True, True, True, True]
    for norm in ("group_std", "none"):
        got = group_advantages(rewards, 4, norm, 1e-6, kept)
        want = loop_advantages(rewards.tolist(), 4, norm, 1e-6, kept.tolist())
        assert got.tolist() == pytest.approx(want, rel=1e-6, abs=1e-7)
        assert torch.isfinite(got).all()
    # all kept: exactly the unmasked computation
    full = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.2, 0.9])
    assert torch.equal(group_advantages(full, 4, kept=torch.ones(8, dtype=torch.bool)), group_advantages(full, 4))
def test_chunked_logprobs_and_entropy_equal_the_plain_ones_with_gradients():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 7))
    weights = torch.randn(3, 7)
    plain = token_logprobs(logits, ids, temperature=0.7)
    (grad_plain,) = torch.autograd.grad((plain * weights).sum(), logits)
    for chunk_elems in (1 << 28, 3 * 11 * 2, 1):  # one chunk, chunks of 2 positions, one position each
        logp, entropy = token_logprobs_and_entropy(logits, ids, 0.7, chunk_elems=chunk_elems)
        (grad,) = torch.autograd.grad((logp * weights).sum(), logits)
        assert torch.equal(logp, plain) and torch.equal(entropy, token_entropy(logits, 0.7))
        assert torch.allclose(grad, grad_plain, atol=1e-7, rtol=0)


@pytest.mark.parametrize("size", [3, 7, 8])
def test_tied_groups_get_exactly_zero_advantage(size):
    """0.925 * 8 rounds: the float mean is an ulp off, which group_std used to blow up to |A| ~ 0.06 on every member."""
    rewards = torch.tensor([0.925] * size + [0.1] * size + [1.0] + [0.0] * (size - 1))
    for norm in ("group_std", "none"):
        got = group_advantages(rewards, size, norm)
        assert got[:2 * size].tolist() == [0.0] * (2 * size)
        assert got[2 * size] > 0
        kept = torch.ones(3 * size, dtype=torch.bool)
        kept[1] = False  # the masked path: the kept members are still all equal
        masked = group_advantages(torch.where(kept, rewards, torch.nan), size, norm, kept=kept)
        assert masked[:2 * size].tolist() == [0.0] * (2 * size)
