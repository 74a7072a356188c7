"""GradlocCallback under Lightning's ``strategy="ddp"`` (4 gloo CPU processes; tests/integrations/distributed/lightning_job.py):
the callback watches the ``DistributedDataParallel`` wrapper, so the monitor is a DDP job — every rank judges
the job's gradient, one incident names the rank whose data holds the corrupted token, ≤ 3 probes, and the
parameters are bitwise those of the same fit without gradloc."""
from __future__ import annotations

import pytest

from tests.distributed.launch import run
from tests.distributed.loop import one_job_incident
from tests.integrations.distributed.lightning_job import MB, POS, ROW, STEPS, UID0, K, planted_row

pytest.importorskip("lightning")

WORLD = 4  # with DDP's defaults (broadcast_buffers) and the culprit on the last rank: tests/defaults's case
pytestmark = pytest.mark.defaults


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from tests.integrations.distributed.lightning_job import train

    return run(train, WORLD, timeout_s=900)


def test_the_callback_watches_lightning_ddp_as_one_job(ranks):
    for r in ranks:
        assert r["strategy"] == "DDPStrategy" and r["world"] == WORLD and r["kind"] == "ddp", r
        assert r["degraded"] is None and not r["counters"], r
        assert r["steps"] == STEPS
    assert all(r["norms"] == ranks[0]["norms"] for r in ranks)  # the job's (all-reduced) gradient on every rank


def test_a_token_planted_on_the_last_rank_is_one_job_incident_naming_it(ranks):
    one_job_incident(ranks, K, (WORLD - 1, MB, ROW, str(UID0 + planted_row(WORLD))), POS - 1)


def test_parameters_are_bitwise_those_of_the_fit_without_gradloc(ranks):
    assert all(r["same_params"] for r in ranks)
