"""Tensor and sequence parallelism (DTensor ``parallelize_module``), alone on 2 gloo processes and as 2D
FSDP2 × TP on a (dp 2, tp 2) mesh of 4: per-layer norms equal a single-process reference within 1e-5
relative (replicated parameters counted once, Partial gradients summed first), per-token scores equal the
reference's once the tp group summed them, a culprit planted on a data rank is localized with ≤ 3 probes
and named with that data rank, and the parameters come out bitwise the same with and without gradloc."""
from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run
from tests.distributed.tp_job import reference

STEPS, PLANT_STEP = 7, 6


def _bitwise(rank: int, world: int, tp: int, sp: bool, plant: tuple) -> dict:
    from tests.distributed.tp_job import train as tr

    plain = tr(rank, world, tp, sp, STEPS, plant=plant, monitor=False)
    watched = tr(rank, world, tp, sp, STEPS, plant=plant)
    same = all(torch.equal(plain["params"][n], watched["params"][n]) for n in plain["params"])
    return {**watched, "bitwise": same}


def _check_norms(got: dict, ref: dict) -> None:
    assert set(got) == set(ref["layers"])
    for layer, norm in ref["layers"].items():
        assert got[layer] == pytest.approx(norm, rel=1e-5), layer


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "replicated"])
def test_tensor_parallel_alone(sp):
    plant = (0, PLANT_STEP, 1, 2, 5)
    results = run(_bitwise, 2, 2, sp, plant, timeout_s=300)
    ref = reference(STEPS, 1)
    for r in results:
        assert r["bitwise"], "parameters differ with gradloc attached"
        rep0 = r["reports"][0]
        _check_norms(rep0["layers"], ref)  # the job's per-layer norms: the tp shards and replicas counted right
        assert [t[:3] for t in rep0["top"]] == [t[:3] for t in ref["top"]]
        for (*_, got), (*_, want) in zip(rep0["top"], ref["top"]):
            assert got == pytest.approx(want, rel=1e-4)  # the tp group's summed scores are the whole model's
        assert rep0["unattributed"] == pytest.approx(0.0, abs=1e-9)
        loc = r["reports"][PLANT_STEP]["loc"]
        assert loc is not None and loc["status"] == "located" and loc["probes"] <= 3, loc
        assert loc["culprits"][0] == (0, 1, 2, 5)
    assert results[0]["reports"][PLANT_STEP]["loc"] == results[1]["reports"][PLANT_STEP]["loc"]


def test_fsdp_x_tp_2d():
    plant = (1, PLANT_STEP, 0, 3, 9)  # on data rank 1 (global ranks 2 and 3)
    results = run(_bitwise, 4, 2, True, plant, timeout_s=480)
    ref = reference(STEPS, 2)
    for r in results:
        assert r["bitwise"], "parameters differ with gradloc attached"
        _check_norms(r["reports"][0]["layers"], {"layers": _by_module(ref["norms"])})
        loc = r["reports"][PLANT_STEP]["loc"]
        assert loc is not None and loc["status"] == "located" and loc["probes"] <= 3, loc
        assert loc["culprits"][0] == (1, 0, 3, 9)  # named with its data rank
    assert len({repr(r["reports"][PLANT_STEP]["loc"]) for r in results}) == 1


def _by_module(norms: dict) -> dict:
    out: dict[str, float] = {}
    for name, n in norms.items():
        mod = name.rsplit(".", 1)[0]
        out[mod] = (out.get(mod, 0.0) ** 2 + n ** 2) ** 0.5
    return out
