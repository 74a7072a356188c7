"""GradlocVerlHooks under FSDP2 on 2 gloo processes, in the main environment (tests/integrations/distributed/verl_fsdp_job.py):
the engine's module sharded with ``fully_shard`` is a job of kind "fsdp", so every rank probes in lockstep and
a mismatch planted on rank 1 is one job incident naming rank 1; training is bitwise unchanged. verl's FSDP1
(flat parameters) is refused at attach. verl's own engine: the real-verl tier (tests/verl_tier).
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run

STEPS, SPIKE = 7, 6


def _rank_main(rank: int, world: int) -> dict:
    from tests.integrations.distributed.verl_fsdp_job import train

    watched = train(rank, world, STEPS, (1, SPIKE), True)
    plain = train(rank, world, STEPS, (1, SPIKE), False)
    watched["same_params"] = all(torch.equal(p, watched["params"][n]) for n, p in plain["params"].items())
    del watched["params"]
    return watched


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run(_rank_main, 2, timeout_s=300)


def test_a_mismatch_on_rank_1_is_located_with_lockstep_probes_as_one_job_incident(ranks):
    locs = []
    for r in ranks:
        assert r["kind"] == "fsdp" and r["probes"] is True and r["errors"] == 0
        assert [rep[0] for rep in r["reports"]] == pytest.approx(r["grad_norms"], rel=1e-5)  # the engine's norm
        assert all(rep[2] is None for rep in r["reports"][:SPIKE])
        _, scope, loc = r["reports"][SPIKE]
        assert scope == "job" and loc.status == "located" and 1 <= loc.probes <= 3, loc.note
        top = loc.culprits[0]
        assert (top.rank, top.micro_batch, top.sample, top.sample_id) == (1, 1, 1, "u2#1")
        assert top.position - top.sample_info.response_start == 2
        assert 0.9 < loc.explained_share < 1.1, loc.explained_share
        locs.append(loc)
    assert repr(locs[0]) == repr(locs[1])


def test_training_is_bitwise_identical_with_and_without_gradloc(ranks):
    assert all(r["same_params"] for r in ranks)


def test_an_fsdp1_module_is_refused_at_attach():
    from tests.integrations.distributed.verl_fsdp_job import fsdp1_refused

    (msg,) = run(fsdp1_refused, 1, timeout_s=120)
    assert "strategy=fsdp2" in msg, msg
