"""TRL's own GRPOTrainer with a reference model (beta 0.1) on 2 gloo ranks (tests/defaults/trl_job.py): the Trainer
wraps the policy in DDP and gradloc watches one DDP job; its norm is TRL's logged pre-clip ``grad_norm`` on every
step and rank; test_trl's stale old log-prob, planted on rank 1 only after the detector's warm-up, is one job
incident located on data rank 1 in ≤ 3 probes naming the token, with no collective deadline; the parameters are
bitwise those of the same run without gradloc."""
from __future__ import annotations

import pytest

from tests.defaults.trl_job import PLANT_OFF
from tests.distributed.launch import run

pytest.importorskip("trl")
pytest.importorskip("datasets")

WORLD = 2
DEADLINE_S = 60.0  # WatchConfig.collective_timeout_s's default


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from tests.defaults.trl_job import train

    return run(train, WORLD, str(tmp_path_factory.mktemp("trl-ddp")), timeout_s=1500)


def test_grpo_with_a_reference_model_runs_ddp_and_gradloc_reports_trls_norm(ranks):
    for r in ranks:
        assert (r["distributed_type"], r["wrapped"]) == ("DistributedType.MULTI_CPU", "DistributedDataParallel")
        assert r["ref_model"] and r["kl_logged"]
        assert r["kind"] == "ddp" and r["errors"] == 0 and not r["counters"] and r["broken"] == "", r
        assert len(r["norms"]) == len(r["logged"]) and r["norms"] == pytest.approx(r["logged"], rel=1e-5)


def test_the_stale_token_on_rank_1_is_one_job_incident_naming_it(ranks):
    from tests.integrations.test_trl import STEPS, K

    step, mb, row, _, _ = ranks[-1]["planted"]
    assert ranks[0]["planted"] == PLANT_OFF and K <= step < STEPS - 1
    locs = []
    for r in ranks:
        assert [(s, scope) for s, scope, _ in r["incidents"]] == [(step, "job")], r["incidents"]
        loc = r["incidents"][0][2]
        assert loc.status == "located" and 1 <= loc.probes <= 3, loc.note
        top = loc.culprits[0]
        assert (top.rank, top.micro_batch, top.sample) == (WORLD - 1, mb, row)
        assert (top.position, top.text) == ranks[-1]["expected"]  # completion token t, scored at P - 1 + t
        assert top.sample_id in {f"{ranks[-1]['pid']}:{k}" for k in (0, 1)}  # "<dataset id>:<generation>"
        assert {c.rank for c in loc.culprits} == {WORLD - 1} and loc.explained_share > 0.9
        assert r["seconds"][step] < DEADLINE_S / 2, r["seconds"][step]  # end_step with its probes
        locs.append(repr(loc))
    assert len(set(locs)) == 1  # the same answer on every rank


def test_parameters_bitwise_those_of_trls_own_trainer(ranks):
    assert all(r["same_params"] and r["same_planted"] for r in ranks)
