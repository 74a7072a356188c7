"""GradlocCallback under Lightning's ``strategy="ddp"`` (2 gloo CPU processes; tests/distributed/lightning_job.py):
the callback watches the ``DistributedDataParallel`` wrapper, so the monitor is a DDP job — every rank judges
the job's gradient, one incident names the rank whose data holds the corrupted token, ≤ 3 probes, and the
parameters are bitwise those of the same fit without gradloc."""
from __future__ import annotations

import pytest

from tests.distributed.launch import run
from tests.distributed.lightning_job import MB, POS, ROW, STEPS, UID0, K, planted_row

pytest.importorskip("lightning")

WORLD = 2


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from tests.distributed.lightning_job import train

    return run(train, WORLD, timeout_s=420)


def test_the_callback_watches_lightning_ddp_as_one_job(ranks):
    for r in ranks:
        assert r["strategy"] == "DDPStrategy" and r["world"] == WORLD and r["kind"] == "ddp", r
        assert r["degraded"] is None and not r["counters"], r
        assert r["steps"] == STEPS
    assert ranks[0]["norms"] == ranks[1]["norms"]  # the job's (all-reduced) gradient on every rank


def test_a_token_planted_on_rank_1_is_one_job_incident_naming_rank_1(ranks):
    locs = []
    for r in ranks:
        assert [(step, scope) for step, scope, _ in r["incidents"]] == [(K, "job")], r["incidents"]
        loc = r["incidents"][0][2]
        assert loc.status == "located" and 1 <= loc.probes <= 3, loc.note
        assert {c.rank for c in loc.culprits} == {1}
        top = loc.culprits[0]
        assert (top.micro_batch, top.sample, top.sample_id) == (MB, ROW, str(UID0 + planted_row(WORLD)))
        assert POS - 1 in {c.position for c in loc.culprits}
        assert 0.5 < loc.explained_share < 1.1, loc.explained_share
        locs.append(loc)
    assert repr(locs[0]) == repr(locs[1])


def test_parameters_are_bitwise_those_of_the_fit_without_gradloc(ranks):
    assert all(r["same_params"] for r in ranks)
