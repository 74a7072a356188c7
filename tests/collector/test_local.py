"""``layer_stats.local``: a DTensor's shard for reading statistics, without autograd (collector/layer_stats.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradloc.collector.layer_stats import local


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if owned:
            dist.destroy_process_group()


def test_a_dtensor_parameter_gives_its_shard_outside_autograd(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    got = local(p)
    assert type(got) is torch.Tensor and not got.requires_grad and got.grad_fn is None
    assert torch.equal(got, p.to_local()) and got.data_ptr() == p.to_local().data_ptr()  # the shard itself, no copy
    (p.to_local() * 2).sum().backward()  # the parameter still trains as before
    assert torch.equal(local(p.grad), torch.full((8, 4), 2.0))


def test_plain_tensors_pass_through_and_other_subclasses_use_to_local():
    t = torch.randn(3, requires_grad=True)
    assert local(t) is t

    class Wrapped:
        def __init__(self, inner: torch.Tensor) -> None:
            self.inner = inner

        def to_local(self) -> torch.Tensor:
            return self.inner

    inner = torch.ones(2)
    assert local(Wrapped(inner)) is inner  # type: ignore[arg-type]
