"""GradlocOpenRLHF on real DeepSpeed ZeRO engines (CPU accelerator, gloo, 2 processes) with OpenRLHF 0.11.2's
own Experience, Actor, PolicyLoss, DeepspeedStrategy and loss normalizers (tests/integrations/distributed/openrlhf_job.py).

The hooks watch the engine itself (``gradloc.watch(engine)``): ZeRO-2 — OpenRLHF's default — and ZeRO-1/3
localize a corrupted rollout log-prob planted on rank 1 as one job incident on both ranks, with probes
(DeepSpeed's probe path: the replayed training_step's loss returned to gradloc, differentiated by
``torch.autograd.grad`` on the engine's raw module), the share measured against ZeRO's partitioned
gradient; the recorded norm is DeepSpeed's own pre-clip norm, and ZeRO-2's parameters after training are
bitwise those of the same run without gradloc.
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.distributed.ds_common import ENV, HAS_DEEPSPEED
from tests.distributed.launch import run

pytestmark = pytest.mark.skipif(not (HAS_DEEPSPEED and importlib.util.find_spec("openrlhf")),
                                reason="needs deepspeed and openrlhf (scripts/setup.sh installs both)")

STEPS, SPIKE = 7, 6
PLANT = (1, SPIKE)  # rank 1, step 6


def _rank_main(rank: int, world: int) -> dict:
    import time

    import torch

    from tests.integrations.distributed.openrlhf_job import train

    out, seconds = {}, {}
    for stage, watched in ((2, True), (2, False), (1, True), (3, True)):
        t0 = time.monotonic()
        out[(stage, watched)] = train(rank, world, stage, STEPS, PLANT, watched)
        seconds[(stage, watched)] = time.monotonic() - t0
    plain, watched = out.pop((2, False)), out[(2, True)]
    watched["same_params"] = all(torch.equal(p, watched["params"][n]) for n, p in plain["params"].items())
    for r in out.values():
        del r["params"]
    return {"runs": out, "seconds": seconds}


@pytest.fixture(scope="module")
def ranks(ds_shm_op) -> list[dict]:
    return run(_rank_main, 2, timeout_s=540, env=ENV)


@pytest.mark.parametrize("stage", [2, 1, 3])
def test_a_corrupted_rollout_logprob_on_rank_1_is_one_located_job_incident(ranks, stage):
    planted = ranks[1]["runs"][(stage, True)]["planted"]
    assert planted is not None and ranks[0]["runs"][(stage, True)]["planted"] is None
    locs = []
    for r in ranks:
        got = r["runs"][(stage, True)]
        assert got["kind"] == "deepspeed" and got["probes"] is True  # the engine itself, probes on
        assert got["errors"] == 0 and not got["counters"], got["counters"]
        assert all(rep[3] is None for rep in got["reports"][:SPIKE])  # no false alarm before the spike
        norm, kinds, scope, loc = got["reports"][SPIKE]
        assert "grad_spike" in kinds and scope == "job"
        assert loc.status == "located" and 1 <= loc.probes <= 3, loc.note
        top = loc.culprits[0]
        assert (top.rank, top.micro_batch, top.sample, top.position) == (1, *planted)  # action j: position j
        assert top.classification.kind == "train_inference_mismatch"
        assert top.rl.log_ratio == pytest.approx(8.0, abs=0.1)
        # ∇_C combined over ranks (÷ W, as DeepSpeed averages) against ZeRO's partitioned gradient; a probe
        # scaled twice by 1/gas would read 0.5, one not combined over the ranks 2.0
        assert 0.9 < loc.explained_share < 1.1, loc.explained_share
        locs.append(loc)
    assert repr(locs[0]) == repr(locs[1])


@pytest.mark.parametrize("stage", [2, 1, 3])
def test_the_norm_is_deepspeeds_pre_clip_norm(ranks, stage):
    for r in ranks:
        got = r["runs"][(stage, True)]
        assert [rep[0] for rep in got["reports"]] == pytest.approx(got["ds_norms"], rel=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_policy_entropy_is_the_actor_s_on_each_rank_and_the_job_s_over_both(ranks, stage):
    """OpenRLHF's Actor computes the token entropies (``entropy_coef`` 0): each rank's record has the mean over its
    actions of the outputs its loss got (read by the job's own hook on the actor), every rank the job's over both.
    The spike step is left out: its probes run the actor again (the hook reads those too)."""
    runs = [r["runs"][(stage, True)] for r in ranks]
    for s in range(SPIKE):
        sums = [r["entropy_sums"][s] for r in runs]
        job = sum(a for a, _ in sums) / sum(n for _, n in sums)
        for r, (a, n) in zip(runs, sums):
            own, job_got = r["entropy"][s]
            assert own == pytest.approx(a / n, rel=1e-6) and job_got == pytest.approx(job, rel=1e-6)
    assert runs[0]["entropy"][0][0] != runs[1]["entropy"][0][0]  # the ranks' own differ: the job's is a combination


def test_zero2_training_is_bitwise_identical_with_and_without_gradloc(ranks):
    assert all(r["runs"][(2, True)]["same_params"] for r in ranks)
