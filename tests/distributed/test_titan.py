"""torchtitan 0.3.0's own Llama 3 under its own TP and FSDP2 × TP functions (tests/titan.py), on 2 and 4 gloo
processes: the case that used to come out wrong silently (replicated norm weights counted once per tp rank,
DTensor scores refused, nothing attributed). gradloc's global norm equals torchtitan's own placement-aware
norm and each layer's norm its parameters' whole gradients' within 1e-5; nothing is unattributed; a culprit
planted on data rank 1 is located with ≤ 3 probes and named with that rank; training is bitwise unchanged."""
from __future__ import annotations

import pytest

from tests import titan
from tests.distributed.launch import run

pytestmark = pytest.mark.skipif(not titan.HAS_TITAN, reason="needs torchtitan (the titan extra: scripts/setup.sh)")
STEPS, AT = 7, 6


def _job(rank: int, world: int, kind: str, plant: tuple) -> dict:
    from tests.distributed.titan_job import train_both

    return train_both(rank, world, kind, STEPS, plant)


@pytest.mark.parametrize("kind,world,plant", [("tp", 2, (0, AT, 1, 2, 5)), ("fsdp-tp", 4, (1, AT, 0, 3, 9))])
def test_torchtitan_llama_under_its_own_tp(kind, world, plant):
    results = run(_job, world, kind, plant, timeout_s=600)
    from tests.distributed.titan_job import reference_top

    ref = reference_top(kind, STEPS)
    for r in results[:2]:  # data rank 0's tp ranks: their summed scores are the unparallelized model's
        assert [t[:3] for t in r["reports"][0]["top"]] == [t[:3] for t in ref]
        for got, want in zip(r["reports"][0]["top"], ref):
            assert got[3] == pytest.approx(want[3], rel=1e-4)
    for r in results:
        assert r["bitwise"], "parameters differ with gradloc attached"
        first = r["reports"][0]
        assert first["norm"] == pytest.approx(r["titan_norm"], rel=1e-5)
        assert set(first["layers"]) == set(r["ref_layers"])
        for layer, norm in r["ref_layers"].items():
            assert first["layers"][layer] == pytest.approx(norm, rel=1e-5), layer
        assert first["unattributed"] == pytest.approx(0.0, abs=1e-9)
        loc = r["reports"][AT]["loc"]
        assert loc is not None and loc["status"] == "located" and loc["probes"] <= 3, loc
        assert loc["culprits"][0] == plant[:1] + plant[2:]  # named with its data rank
    assert len({repr(r["reports"][AT]["loc"]) for r in results}) == 1  # one answer on every rank
