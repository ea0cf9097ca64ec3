"""Token log-probs through the decoder + chunked LM head equal the full-logits definition."""

from __future__ import annotations

import pytest
import torch

from rlspec.core.batch import position_ids
from rlspec.core.grpo import token_entropy, token_logprobs, token_logprobs_and_entropy
from rlspec.models.factory import load_model
from rlspec.core.policy import _decoder_and_head, forward_logits, forward_logprobs
from rlspec.spec import ModelSpec


def test_chunked_head_path_equals_full_logits_with_gradients():
    model = load_model(ModelSpec(), seed=0)
    ids = torch.randint(4, 260, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    logits = forward_logits(model, ids, mask)
    plain = token_logprobs(logits, ids, 0.7)
    (grad_plain,) = torch.autograd.grad(plain.sum(), model.lm_head.weight)
    logp, entropy = forward_logprobs(model, ids, mask, 0.7)  # one chunk: the very same ops
    assert torch.equal(logp, plain) and torch.equal(entropy, token_entropy(logits.detach(), 0.7))
    decoder, head = _decoder_and_head(model)
    hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).last_hidden_state
    chunked, _ = token_logprobs_and_entropy(hidden, ids, 0.7, head=head, chunk_elems=3 * 260 * 2)
    (grad,) = torch.autograd.grad(chunked.sum(), model.lm_head.weight)
    # The chunked backward adds each chunk's head gradient into one buffer: the same sums in another order,
    # so equal up to float32 rounding (about 1e-6 here), not bit for bit.
    assert torch.allclose(chunked, plain, atol=1e-6) and torch.allclose(grad, grad_plain, atol=1e-5)


def test_wrapped_models_use_their_own_forward():
    assert _decoder_and_head(torch.nn.Linear(2, 2)) is None


def test_chunked_head_gradients_equal_autograd_for_states_weight_and_bias():
    torch.manual_seed(0)
    head = torch.nn.Linear(6, 13, bias=True)
    hidden = torch.randn(2, 8, 6, requires_grad=True)
    ids = torch.randint(0, 13, (2, 8))
    weights = torch.randn(2, 8)
    plain = token_logprobs(head(hidden), ids, 0.7)
    want = torch.autograd.grad((plain * weights).sum(), (hidden, head.weight, head.bias))
    logp, entropy = token_logprobs_and_entropy(hidden, ids, 0.7, head=head, chunk_elems=13 * 3)  # 3 rows a chunk
    got = torch.autograd.grad((logp * weights).sum(), (hidden, head.weight, head.bias))
    assert torch.allclose(logp, plain, atol=1e-6) and not entropy.requires_grad  # head(chunk): other matmul shapes
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6, rtol=0)


def test_fused_head_equals_the_plain_head_in_log_probs_entropy_and_gradients():
    """The fused chunk (`_head_stats` / `_head_grad`, compiled on CUDA) is the same math as the plain chunk;
    here both run eagerly in fp32, at two temperatures, over chunks of 3 rows and one chunk, with a vocabulary
    reduced whole (13) and one reduced in 4 parts (4,096)."""
    from rlspec.core.grpo import vocab_splits

    assert (vocab_splits(13), vocab_splits(4096), vocab_splits(151936)) == (1, 4, 64)
    for vocab in (13, 4096):
        _fused_equals_plain(vocab)


def _fused_equals_plain(vocab: int) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(6, vocab, bias=True)
    hidden = torch.randn(2, 8, 6, requires_grad=True) * 3  # peaked distributions: the parts' maxima differ
    ids = torch.randint(0, vocab, (2, 8))
    weights = torch.randn(2, 8)
    for temperature in (1.0, 0.7):
        for chunk_elems in (vocab * 3, 1 << 20):
            outs = {}
            for fused in (False, True):
                logp, entropy = token_logprobs_and_entropy(hidden, ids, temperature, head=head,
                                                           chunk_elems=chunk_elems, fused=fused)
                grads = torch.autograd.grad((logp * weights).sum(), (hidden, head.weight, head.bias))
                outs[fused] = (logp, entropy, *grads)
            assert not outs[True][1].requires_grad
            for got, want in zip(outs[True], outs[False]):
                assert torch.allclose(got, want, atol=1e-5, rtol=0), (vocab, temperature, chunk_elems)


@pytest.mark.gpu
def test_fused_head_on_cuda_bf16_matches_the_plain_head():
    """On CUDA in bf16 the chunked head runs fused (the Triton kernels) by default: log-probs and entropies as the
    plain fp32 chunk computes them from the same bf16 logits (up to summation order), gradients within bf16
    rounding, over several chunks and a second length."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 5000, bias=False).cuda().to(torch.bfloat16)
    for length in (300, 171):
        hidden = torch.randn(2, length, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ids = torch.randint(0, 5000, (2, length), device="cuda")
        weights = torch.randn(2, length, device="cuda")
        outs = {}
        for fused in (None, False):  # None: the default, fused here
            logp, entropy = token_logprobs_and_entropy(hidden, ids, 0.9, head=head, chunk_elems=5000 * 2 * 64,
                                                       fused=fused)
            grads = torch.autograd.grad((logp * weights).sum(), (hidden, head.weight))
            outs[fused] = (logp, entropy, *grads)
        (logp, entropy, g_hidden, g_weight), (p_logp, p_entropy, p_hidden, p_weight) = outs[None], outs[False]
        assert torch.allclose(logp, p_logp, atol=1e-4) and torch.allclose(entropy, p_entropy, atol=1e-4)
        for got, want in ((g_hidden, p_hidden), (g_weight, p_weight)):
            assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), float((got - want).abs().max())


def test_micro_batches_of_uneven_length_carry_every_token_aligned_field():
    """`micro_batches` trims each micro-batch to its own longest sequence; every [N, L] field (the engine's
    log-probs for TIS included) must be trimmed with it, or the loss fails on a shape mismatch (an agent's
    trajectories of different lengths did)."""
    from rlspec.core.batch import TOKEN_ALIGNED, TrainBatch
    from rlspec.core.grpo import LossConfig, LossNorm
    from rlspec.core.policy import accumulate

    model = load_model(ModelSpec(), seed=0)
    lengths = [9, 9, 5, 4]  # the second micro-batch of 2 is 4 columns shorter than the batch
    width = max(lengths)
    ids = torch.randint(3, 100, (4, width))
    attention = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    loss_mask = attention.float()
    loss_mask[:, :2] = 0.0
    batch = TrainBatch(input_ids=ids, attention_mask=attention, loss_mask=loss_mask,
                       advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), rewards=torch.zeros(4),
                       engine_logprobs=torch.full((4, width), -1.0) * loss_mask)
    fields = [f for f in TOKEN_ALIGNED if getattr(batch, f) is not None]
    for mb in batch.micro_batches(2, "cpu"):
        assert {getattr(mb, f).shape[1] for f in fields} == {mb.real_length()}
    stats = accumulate(model, batch, 2, LossNorm.of(batch.loss_mask, width), LossConfig(tis_cap=2.0), 1.0,
                       lambda loss: loss.backward(), "cpu")
    assert all(torch.isfinite(torch.tensor(float(v))) for v in stats.values())


def test_accumulate_can_leave_its_sums_on_the_device_until_read():
    """`read_now=False` (the standalone trainer, which queues its optimizer step before reading): the same sums,
    held as a tensor until the first read, then read once; no micro-batch (an empty shard) reads as zeros."""
    from rlspec.core.batch import TrainBatch
    from rlspec.core.grpo import LossConfig, LossNorm
    from rlspec.core.policy import STAT_KEYS, DeviceSums, accumulate

    model = load_model(ModelSpec(), seed=0)
    ids = torch.randint(3, 100, (4, 9))
    attention = torch.ones(4, 9, dtype=torch.long)
    loss_mask = attention.float()
    loss_mask[:, :3] = 0.0
    batch = TrainBatch(input_ids=ids, attention_mask=attention, loss_mask=loss_mask,
                       advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), rewards=torch.zeros(4))
    run = dict(model=model, shard=batch, micro_batch_size=2, norm=LossNorm.of(loss_mask, 9), cfg=LossConfig(),
               temperature=1.0, backward=lambda loss: loss.backward(), device="cpu")
    now = accumulate(**run)
    later = accumulate(**run, read_now=False)
    assert type(now) is dict and isinstance(later, DeviceSums)
    assert later._values is None and later._totals is not None  # nothing read yet
    assert later["tokens"] == now["tokens"] == 24.0 and later._totals is None
    assert dict(later) == now and list(later) == list(STAT_KEYS)
    assert dict(DeviceSums(None)) == dict.fromkeys(STAT_KEYS, 0.0)
