"""Token log-probs through the decoder + chunked LM head equal the full-logits definition."""

from __future__ import annotations

import torch

from rlspec.batch import position_ids
from rlspec.grpo import token_entropy, token_logprobs, token_logprobs_and_entropy
from rlspec.models import load_model
from rlspec.policy import _decoder_and_head, forward_logits, forward_logprobs
from rlspec.spec import ModelSpec


def test_chunked_head_path_equals_full_logits_with_gradients():
    model = load_model(ModelSpec(), seed=0)
    ids = torch.randint(4, 260, (3, 9))
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
    assert torch.allclose(chunked, plain, atol=1e-6) and torch.allclose(grad, grad_plain, atol=1e-6)


def test_wrapped_models_use_their_own_forward():
    assert _decoder_and_head(torch.nn.Linear(2, 2)) is None
