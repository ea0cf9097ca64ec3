"""The optimizer step and the gradient norm of a sharded (DTensor) model, run on each rank's local shards.

AdamW, weight decay and gradient clipping are elementwise, so a rank can apply them to its own shards as
plain tensors and get exactly what the DTensor path computes; only the norm needs a sum over the ranks. On
DTensors each of these is one dispatch over lists of ~300 tensors with a sharding rule per tensor: measured in
an fsdp rank on one H100 (0.5B shape), the fused AdamW step took 11.6 ms of host time per step (3.4 ms on plain
tensors) and the norm and clip about 9 ms, both with the GPU idle.

Only parameters sharded on every mesh dimension qualify (FSDP2's `Shard(0)` on a 1-D mesh): a replicated
one would be counted once per rank in the norm. Anything else takes the DTensor path (`local_shards` is None).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor


def local_shards(params: list[Tensor]) -> list[Tensor] | None:
    """Each parameter's local shard (sharing its storage), or None when they are not all DTensors sharded on
    one mesh, every placement a `Shard`."""
    from torch.distributed.tensor import DTensor, Shard

    if not params or not all(isinstance(p, DTensor) for p in params):
        return None
    mesh = params[0].device_mesh
    if any(p.device_mesh != mesh or not all(isinstance(s, Shard) for s in p.placements) for p in params):
        return None
    return [p._local_tensor for p in params]


def sharded_grad_norm_and_clip(params: list[Tensor], max_grad_norm: float) -> Tensor | None:
    """Global L2 norm of the gradients of DTensor `params` (before clipping, a 0-dim tensor), from the local shards
    and one all-reduce; clips in place when `max_grad_norm` > 0 the way `clip_grad_norm_` does. None when `params`
    do not qualify (see the module docstring)."""
    import torch.distributed as dist

    params = [p for p in params if p.grad is not None]
    grads = local_shards([p.grad for p in params])
    if grads is None:
        return None
    grads = [g for g in grads if g.numel()]
    foreach = bool(grads) and all(g.is_cuda for g in grads)
    if grads:
        norms = torch._foreach_norm(grads, 2) if foreach else [torch.linalg.vector_norm(g, 2) for g in grads]
        squared = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2) ** 2
    else:
        squared = torch.zeros((), device=params[0].grad._local_tensor.device)
    mesh = params[0].grad.device_mesh
    if mesh.size() > 1:
        dist.all_reduce(squared, group=mesh.get_group())
    norm = squared.sqrt()
    if max_grad_norm > 0 and grads:
        coef = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
        if foreach:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        else:
            for g in grads:
                g.mul_(coef.to(g.dtype))
    return norm


@contextmanager
def stepping_local_shards(optimizer: torch.optim.Optimizer) -> Iterator[bool]:
    """Within the block, `optimizer.step()` updates the local shards of its DTensor parameters as plain tensors
    (in place, so the DTensors see it). Yields False, and changes nothing, when the parameters do not qualify.

    The optimizer keeps its DTensor parameters and DTensor state outside the block, so its state dict (and
    `torch.distributed.checkpoint`) are what they would be without it: state created inside (the first step) is
    wrapped as DTensors laid out like its parameter.
    """
    from torch.distributed.tensor import DTensor

    groups = optimizer.param_groups
    originals = [group["params"] for group in groups]
    params = [p for group in originals for p in group]
    shards = local_shards(params)
    if shards is None:
        yield False
        return
    local = dict(zip(map(id, params), shards))
    state = optimizer.state
    try:
        for group, members in zip(groups, originals):
            group["params"] = [local[id(p)] for p in members]
        for p, shard in zip(params, shards):
            shard.grad = None if p.grad is None else p.grad._local_tensor
            if p in state:
                state[shard] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in state[p].items()}
        yield True
    finally:
        for group, members in zip(groups, originals):
            group["params"] = members
        for p, shard in zip(params, shards):
            shard.grad = None
            shard_state = state.pop(shard, None)
            if shard_state is None:
                continue
            kept = state[p]
            for key, value in shard_state.items():
                if key not in kept:  # created by this step: same layout as the parameter, or a scalar (`step`)
                    kept[key] = (DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                                    shape=p.shape, stride=p.stride())
                                 if value.shape == shard.shape and value.dim() else value)


def step_on_shards(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()` on the local shards where its parameters qualify, else on the parameters as they are."""
    with stepping_local_shards(optimizer):
        optimizer.step()
