"""Parameters on several devices: one packed reduction per device, combined on the primary device.

No machine here has two devices, so the combination is tested by splitting one CPU model's
parameters into two device groups (the collector groups by ``p.device``; here both groups are on
the CPU): the packed statistics must equal those of a single group. A real two-GPU run is the
GPU test below, which skips without two CUDA devices.
"""
from __future__ import annotations

import pytest
import torch

from gradloc.collector.layer_stats import LayerStatsCollector, _DeviceGroup
from tests.helpers import backward_step, make_data, single_thread, tiny_gpt  # noqa: F401


def _split(c: LayerStatsCollector) -> None:
    members = list(range(len(c.params)))
    halves = [members[::2], members[1::2]]
    c._groups = [_DeviceGroup(torch.device("cpu"), m, torch.tensor([c.group_of[i] for i in m], dtype=torch.long))
                 for m in halves]


def test_split_device_groups_give_the_same_pack():
    model = tiny_gpt(0)
    data = make_data(1, 1)
    backward_step(model, data, 0)
    model.head.weight.grad = None  # a parameter without a gradient this step (partial index path)
    one, two = LayerStatsCollector(model, "module"), LayerStatsCollector(model, "module")
    _split(two)
    uncovered = [n.startswith("blocks.0") for n in one.names]
    for c in (one, two):
        c.set_uncovered(uncovered)
    extra = [i for i, n in enumerate(one.names) if n.startswith("pos")]
    a, b = one.grad_pack(0.5, extra), two.grad_pack(0.5, extra)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
    L = one.n_layers
    assert float(a[4 * L]) > 0  # the uncovered + unattributed entry is in use


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_model_on_two_gpus_matches_one_device():  # pragma: no cover - no GPU here
    model = tiny_gpt(0)
    data = make_data(1, 1)
    ref = LayerStatsCollector(model, "module")
    backward_step(model, data, 0)
    want = ref.grad_pack().cpu()
    model.zero_grad()
    model.blocks[0].to("cuda:0")
    model.blocks[1].to("cuda:1")
    # the plain forward moves activations: wrap the blocks so inputs follow them
    for blk, dev in ((model.blocks[0], "cuda:0"), (model.blocks[1], "cuda:1")):
        blk.register_forward_pre_hook(lambda m, args, dev=dev: tuple(a.to(dev) for a in args))
        blk.register_forward_hook(lambda m, args, out: out.cpu())
    backward_step(model, data, 0)
    got = LayerStatsCollector(model, "module")
    assert len(got.devices) == 3
    torch.testing.assert_close(got.grad_pack().cpu(), want, rtol=1e-4, atol=1e-8)
