"""torchtitan with its own default parallelism (tests/defaults/titan_job.py: ``ParallelismConfig()``, FSDP2 over
every rank by its ``parallelize_llama``, its ``clip_grad_norm_`` at max_norm 1.0) around its own Llama 3, 4 gloo
ranks, a token planted on rank 3 after 32 healthy steps, the default detector: gradloc's norm is the one
torchtitan's ``clip_grad_norm_`` returns on every step and rank, one job incident located on data rank 3 in ≤ 3
probes, no collective deadline, training bitwise as without gradloc. (Its default pipeline schedule, 1F1B, runs
in tests/distributed/test_pp.py; its TP / FSDP2 × TP / EP in tests/distributed/test_titan.py.)"""
from __future__ import annotations

import pytest

from tests import titan
from tests.defaults.titan_job import HEALTHY, PLANT, STEPS
from tests.distributed.launch import run

pytestmark = pytest.mark.skipif(not titan.HAS_TITAN, reason="needs torchtitan (the titan extra: scripts/setup.sh)")
WORLD = 4
DEADLINE_S = 60.0  # WatchConfig.collective_timeout_s's default


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from tests.defaults.titan_job import run_both

    return run(run_both, WORLD, timeout_s=900)


def test_default_parallelism_norms_location_and_deadline(ranks):
    for r in ranks:
        w = r["with"]
        assert w["kind"] == "fsdp" and w["dp"] == WORLD and w["placements"] == ["(Shard(dim=0),)"]
        assert w["broken"] == "" and not w["counters"], (w["broken"], w["counters"])
        norms = [e["norm"] for e in w["reports"]]
        assert len(norms) == len(w["clips"]) == STEPS
        assert norms == pytest.approx(w["clips"], rel=1e-5)  # torchtitan's own clip_grad_norm_
        assert [e["step"] for e in w["reports"] if e["loc"] is not None] == [HEALTHY]
        assert w["reports"][HEALTHY]["scope"] == "job"
        loc = w["reports"][HEALTHY]["loc"]
        assert loc["status"] == "located" and 1 <= loc["probes"] <= 3, loc["note"]
        assert loc["culprits"][0] == (WORLD - 1, *PLANT) and {c[0] for c in loc["culprits"]} == {WORLD - 1}
        assert 0.9 < loc["explained"] < 1.1, loc["explained"]
        assert w["seconds"][HEALTHY] < DEADLINE_S / 2, w["seconds"][HEALTHY]  # end_step, probes included
    assert len({repr(r["with"]["reports"][HEALTHY]["loc"]) for r in ranks}) == 1


def test_default_parallelism_trains_bitwise_as_without_gradloc(ranks):
    import torch

    for rank, r in enumerate(ranks):
        for name, p in r["without"]["params"].items():
            assert torch.equal(p, r["with"]["params"][name]), f"rank {rank}: {name} differs"
