"""Counter-based sampling noise: every draw a pure function of (seed, sample index, token position, token id).

The CUDA-graph sampler draws its exponential race noise from here instead of a stateful generator, so a
sample's tokens do not depend on which slot of the pool it ran in or when it started (continuous batching
refills slots at data-dependent times), and the noise is computed inside the captured graph with no
generator state to register.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 values in [0, 2^32). The multipliers are below
    2^31, so no product leaves int64 (a tensor or a Python int alike)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x27D4EB2F) & _MASK32
    return x ^ (x >> 15)


def sample_keys(seed: int, samples: Tensor) -> Tensor:
    """The 32-bit noise key of each sample index in `samples` (int64) under a batch `seed`."""
    base = _mix32(_mix32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))
    return _mix32(_mix32(samples ^ base) ^ _mix32(base ^ 0x9E3779B9))


def sample_key_list(seed: int, first: int, count: int) -> list[int]:
    """`sample_keys(seed, arange(first, first + count))` in Python ints: a server's request of a few rows computes
    its keys without a dozen small tensor ops."""
    base = _mix32(_mix32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))
    salt = _mix32(base ^ 0x9E3779B9)
    return [_mix32(_mix32(i ^ base) ^ salt) for i in range(first, first + count)]


def keyed_exponential(keys: Tensor, steps: Tensor, vocab: int) -> Tensor:
    """[B, vocab] Exp(1) draws, each a pure function of (its row's key, the row's token position `steps`, the
    token id): counter-based noise, so a sample draws the same numbers in whichever slot and batch it runs.

    Two keyed hash rounds per element (a 64-bit key in effect: rows whose 32-bit keys are close do not share
    shifted noise); the uniform keeps 23 bits, so (k + 0.5) / 2^23 is exact in float32 and never 0 or 1 (with 24
    bits the top value would round to 1, an exponential of 0, and win the race whatever its probability).
    """
    return -torch.log(keyed_uniform(keys, steps, vocab))


def keyed_uniform(keys: Tensor, steps: Tensor, vocab: int) -> Tensor:
    """The [B, vocab] uniforms in (0, 1) that `keyed_exponential` takes -log of (the fused head and race of
    `rlspec.rollout.sampled_head` hash the same bits inside its kernel)."""
    row = _mix32(keys ^ _mix32(steps & _MASK32))
    salt = _mix32(row ^ 0x45D9F3B)
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int32)
    x = _mix32_int32(_mix32_int32(ids[None] ^ _as_int32(row)[:, None]) ^ _as_int32(salt)[:, None])
    return open_uniform(x)


def _as_int32(x: Tensor) -> Tensor:
    """int64 values in [0, 2^32) as int32 with the same 32 bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _mix32_int32(x: Tensor) -> Tensor:
    """`_mix32` on the same 32 bits held in int32, bit for bit: products wrap modulo 2^32 (the multipliers are
    below 2^31, so the product stays int32) and each right shift is masked to a logical one. The [B, vocab] noise is hashed here: 64-bit integer products cost a GPU several
    32-bit ones (the decode step's sampler kernel took 80 us at 64 rows x 152k in int64)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x5BD1E995
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x27D4EB2F
    return x ^ ((x >> 15) & 0x1FFFF)


def open_uniform(x: Tensor) -> Tensor:
    """float32 in (0, 1) from 32-bit hashes `x` (int64 in [0, 2^32) or the same bits in int32): the top 23 bits,
    centred in their interval."""
    return (((x >> 9) & 0x7FFFFF).float() + 0.5) * 2.0 ** -23
