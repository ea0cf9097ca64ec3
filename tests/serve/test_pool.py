"""The serving pool's prefill on its own (CPU, fp32): prompts of different widths right-padded into one forward
(as CUDA prefills an admission) give each prompt the K/V and last hidden it gets alone."""

from __future__ import annotations

import torch


def test_prompts_of_different_widths_prefill_together_as_alone():
    from rlspec.models.factory import load_model
    from rlspec.rollout.static import GraphSampler
    from rlspec.serve.pool import ServingPool
    from rlspec.spec import ModelSpec

    model = load_model(ModelSpec(dtype="float32"), 0).eval().requires_grad_(False)
    sampler = GraphSampler(model, torch.device("cpu"))
    prompts = [(5, 9, 13), (7, 8, 9, 10, 11), (3, 4, 6, 2)]
    together = ServingPool(sampler, 64, 8, eos=0)
    together._prefill_part(prompts)
    (batch, _), = {id(b): (b, i) for b, i in (together._prompts[p] for p in prompts)}.values()
    assert batch.width == 5 and batch.hidden.shape[0] == 3, "one forward, padded to the longest prompt"
    for p in prompts:
        alone = ServingPool(sampler, 64, 8, eos=0)
        alone.prefill([list(p)])
        own, _ = alone._prompts[p]
        _, row = together._prompts[p]
        torch.testing.assert_close(batch.hidden[row], own.hidden[0], rtol=1e-5, atol=1e-5)
        for mine, theirs in zip(batch.keys + batch.values, own.keys + own.values):
            torch.testing.assert_close(mine[row, :, :len(p)], theirs[0], rtol=1e-5, atol=1e-5)
    # the padded rows' hidden is their own last token's, not the padding's
    assert not torch.allclose(batch.hidden[0], batch.hidden[1])


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
