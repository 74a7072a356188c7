"""torchtitan 0.3.0's own Llama 3 under its own TP and FSDP2 × TP functions and its Qwen3-MoE and DeepSeek-V3 under its own EP
(tests/titan.py), on 2 and 4 gloo processes: the case that used to come out wrong silently (replicated norm weights counted once per tp rank,
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


CASES = [("tp", 2, (0, AT, 1, 2, 5)), ("fsdp-tp", 4, (1, AT, 0, 3, 9)), ("ep", 2, (1, AT, 1, 1, 4)),
         ("ep-dsv3", 2, (1, AT, 0, 2, 11))]


@pytest.mark.parametrize("kind,world,plant", CASES, ids=[c[0] for c in CASES])
def test_torchtitan_models_under_their_own_parallelisms(kind, world, plant):
    """Llama 3 under TP and FSDP2 × TP; Qwen3-MoE and DeepSeek-V3 under EP (their experts' scores computed where they
    live and sent back to their tokens' ranks by one all-to-all; DeepSeek-V3's MLA low-rank kv path, its kv_norm and
    its shared expert scored where they run)."""
    results = run(_job, world, kind, plant, timeout_s=600)
    from tests.distributed.titan_job import KINDS, reference_top

    ref = reference_top(kind, STEPS)
    rtol = 1e-2 if kind.startswith("ep") else 1e-4  # torchtitan's grouped experts run in bf16, grouped differently under EP
    for r in results[:world // KINDS[kind].get("dp_shard", 1)]:  # data rank 0's ranks: the unparallelized scores
        assert [t[:3] for t in r["reports"][0]["top"]] == [t[:3] for t in ref]
        for got, want in zip(r["reports"][0]["top"], ref):
            assert got[3] == pytest.approx(want[3], rel=rtol)
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
