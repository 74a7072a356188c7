"""GradlocTrainer under DDP: a real ``transformers.Trainer`` on 4 gloo CPU processes (accelerate's MULTI_CPU).

The Trainer wraps the model in ``DistributedDataParallel``; GradlocTrainer hands gradloc that wrapper, so
the monitor is a DDP job: every rank judges the job's (all-reduced) gradient, the rank holding the
candidates probes in ``no_sync`` and gradloc combines the probe gradients over the ranks. A corrupted
token planted on the last rank (tests/integrations/distributed/hf_trainer_job.py) is one job incident on every rank, naming
it, with ≤ 3 probes and the share measured against the job's gradient; the parameters after
training are bitwise those of a plain ``Trainer`` on the same data.
"""
from __future__ import annotations

import pytest

from tests.distributed.launch import run
from tests.distributed.loop import one_job_incident
from tests.integrations.distributed.hf_trainer_job import MB, POS, ROW, STEPS, UID0, K, planted_row

pytest.importorskip("transformers")

WORLD = 4  # with DDP's defaults (broadcast_buffers) and the culprit on the last rank: tests/defaults's case
pytestmark = pytest.mark.defaults


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from tests.integrations.distributed.hf_trainer_job import train

    return run(train, WORLD, str(tmp_path_factory.mktemp("hf-ddp")), timeout_s=900)


def test_the_trainer_runs_ddp_and_gradloc_watches_it_as_one_job(ranks):
    for r in ranks:
        assert r["ddp"] and r["distributed_type"] == "DistributedType.MULTI_CPU" and r["world"] == WORLD, r
        assert r["kind"] == "ddp"  # not "single": the job path, not the unwrapped module rank by rank
        assert r["errors"] == 0 and not r["counters"], r["counters"]
        assert len(r["norms"]) == STEPS
        assert r["norms"] == pytest.approx(r["logged"], rel=1e-5)  # the job's norm = the Trainer's grad_norm
    assert all(r["norms"] == ranks[0]["norms"] for r in ranks)  # every rank judges the same (all-reduced) gradient


def test_a_token_planted_on_the_last_rank_is_one_job_incident_naming_it(ranks):
    one_job_incident(ranks, K, (WORLD - 1, MB, ROW, str(UID0 + planted_row(WORLD))), POS - 1, text="Z")


def test_parameters_are_bitwise_those_of_a_plain_trainer(ranks):
    assert all(r["same_params"] for r in ranks)
