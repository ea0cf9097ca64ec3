"""`rlspec.core.shards`: AdamW and the clipped gradient norm on local shards equal the DTensor path, and the
optimizer keeps DTensor state (what `torch.distributed.checkpoint` and the portable state read)."""

from __future__ import annotations

import pytest
import torch

from rlspec.core.shards import local_shards, sharded_grad_norm_and_clip, step_on_shards, stepping_local_shards
from rlspec.core.trainer import grad_norm_and_clip


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def sharded_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    fully_shard(model[0], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def dtensor_norm(params, limit: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    return float(norm.full_tensor())


def test_local_shard_step_and_norm_equal_the_dtensor_path(mesh):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    models = [sharded_model(mesh), sharded_model(mesh)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    data = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        norms = []
        for index, (model, optimizer) in enumerate(zip(models, optimizers)):
            (model(data) ** 2).sum().backward()
            params = list(model.parameters())
            if index == 0:
                norms.append(dtensor_norm(params, 0.5))
                optimizer.step()
            else:
                norms.append(float(grad_norm_and_clip(params, 0.5)))
                step_on_shards(optimizer)
            optimizer.zero_grad(set_to_none=True)
        assert norms[1] == pytest.approx(norms[0], rel=1e-6)
        assert norms[0] > 0.5  # clipping was active
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(b.full_tensor(), a.full_tensor(), rtol=0, atol=1e-7)
    for param in models[1].parameters():
        state = optimizers[1].state[param]
        assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].placements == param.placements
        assert not isinstance(state["step"], DTensor)
    saved = [get_optimizer_state_dict(m, o) for m, o in zip(models, optimizers)]
    for name, state in saved[0]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(saved[1]["state"][name][key].full_tensor() if isinstance(value, DTensor)
                                       else saved[1]["state"][name][key],
                                       value.full_tensor() if isinstance(value, DTensor) else value, rtol=0, atol=1e-7)


def test_what_does_not_qualify_takes_the_dtensor_path(mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor

    plain = [torch.nn.Parameter(torch.ones(3))]
    replicated = [torch.nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Replicate()]))]
    for params in (plain, replicated):
        assert local_shards(params) is None
        params[0].grad = torch.ones_like(params[0])
        assert sharded_grad_norm_and_clip(params, 1.0) is None
        optimizer = torch.optim.SGD(params, lr=0.1)
        with stepping_local_shards(optimizer) as local:
            assert local is False
            assert optimizer.param_groups[0]["params"][0] is params[0]
