"""Megatron-core tensor parallelism (``ColumnParallelLinear`` / ``RowParallelLinear``, activations ``[s, b, h]``)
on 2 gloo processes, ``initialize_model_parallel(tensor_model_parallel_size=2)``: the model's partitions gathered
are bitwise the tp=1 reference's weights; per-layer norms equal that single-process reference's ``.grad`` norms
within 1e-5 relative (partitions added, replicas counted once); per-token scores, summed over the tp group,
equal the reference's; nothing is unattributed; a culprit planted on one token is localized with ≤ 3 probes;
the parameters come out bitwise the same with and without gradloc (tests/distributed/megatron_job.py)."""
from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from tests.distributed.launch import run

STEPS, PLANT_STEP = 7, 6
ENV = {"NO_VCS_VERSION": "1"}  # megatron's package_info would otherwise run `git rev-parse` at import

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="needs megatron-core (scripts/setup.sh)")


def _bitwise(rank: int, world: int, plant: tuple) -> dict:
    from tests.distributed.megatron_job import bitwise

    return bitwise(rank, world, 2, STEPS, plant)


def _reference(rank: int, world: int) -> dict:
    from tests.distributed.megatron_job import reference

    return reference(rank, world, STEPS)


def test_megatron_tensor_parallel():
    plant = (PLANT_STEP, 1, 2, 5)  # (step, micro-batch, sample, position)
    imported = "megatron" in sys.modules
    results = run(_bitwise, 2, plant, timeout_s=300, env=ENV)
    (ref,) = run(_reference, 1, timeout_s=180, env=ENV)
    assert imported or "megatron" not in sys.modules  # no result imports it here (megatron_job.whole_params)
    want = ref["report"]
    assert set(want["layers"]) == set(ref["norms"])  # every module with parameters is a layer
    for layer, norm in ref["norms"].items():  # gradloc's reduction of the reference equals its .grad
        assert want["layers"][layer] == pytest.approx(norm, rel=1e-6), layer
    assert any(".qkv" in n for n in want["layers"]) and want["unattributed"] == pytest.approx(0.0, abs=1e-12)
    for r in results:
        assert r["bitwise"], "parameters differ with gradloc attached"
        for n, p in ref["init"].items():  # the partitions, gathered, are the reference's weights
            assert np.array_equal(r["init"][n], p), n
        rep0 = r["reports"][0]
        assert set(rep0["layers"]) == set(ref["norms"])
        for layer, norm in ref["norms"].items():
            assert rep0["layers"][layer] == pytest.approx(norm, rel=1e-5), layer  # gradloc's, under TP
            assert r["norms"][layer] == pytest.approx(norm, rel=1e-5), layer  # the gathered .grad: same step
        assert rep0["dropped"] == 0 and rep0["unattributed"] == pytest.approx(0.0, abs=1e-9)
        assert [t[:3] for t in rep0["top"]] == [t[:3] for t in want["top"]]
        for (*_, got), (*_, exp) in zip(rep0["top"], want["top"]):
            assert got == pytest.approx(exp, rel=1e-4)  # the tp group's summed scores are the whole model's
        assert rep0["total_score"] == pytest.approx(want["total_score"], rel=1e-4)
        loc = r["reports"][PLANT_STEP]["loc"]
        assert loc is not None and loc["status"] == "located" and loc["probes"] <= 3, loc
        assert loc["culprits"][0] == (0, 1, 2, 5)
    assert results[0]["reports"][PLANT_STEP]["loc"] == results[1]["reports"][PLANT_STEP]["loc"]
