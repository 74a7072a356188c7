"""Collective safety when a rank fails: a probe that raises, a rank that crashes mid-probe.

Training must never wait on gradloc forever: every gradloc collective has a deadline, a failure is
recorded in the incident, and the ranks stay in lockstep wherever that can be kept.
"""
from __future__ import annotations

import os

import torch

from tests.distributed.ddp_job import M, build, data
from tests.distributed.launch import run

STEPS, SPIKE = 9, 7


def _job(rank, world, fault: str):
    import gradloc
    from gradloc.demo.model import token_losses

    model = build("ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y, w = data(rank, STEPS)
    if rank == 1:
        w[SPIKE, 1, 2, 5] = 3000.0
    mon = gradloc.watch(model, opt, store=False, detector=gradloc.DetectorConfig(warmup=5), collective_timeout_s=4)
    out = {"notes": [], "collectives": []}
    for s in range(STEPS):
        def loss_for(i, mask=None, s=s, probe=False):
            if probe and rank == 1 and s == SPIKE:
                if fault == "raise":
                    raise ValueError("the user's probe closure broke")
                if fault == "crash":
                    os._exit(3)  # a rank dying in the middle of a probe
            terms = token_losses(model(x[s, i]), y[s, i]) * w[s, i]
            return (terms * mask if mask is not None else terms).sum() / (terms.numel() * M)

        total = torch.zeros(())
        for i in range(M):
            with mon.micro_batch(y[s, i]):
                loss = loss_for(i)
                loss.backward()
            total += loss.detach()
        before = mon.comm.collectives if mon.comm else 0
        rep = mon.end_step(total, probe=lambda i, mask: loss_for(i, mask, probe=True))
        out["collectives"].append((mon.comm.collectives if mon.comm else 0) - before)
        if rep.incident is not None:
            out["notes"].append((s, rep.incident.localization.status, rep.incident.localization.note))
        if fault == "crash" and s == SPIKE:
            out["left_job"] = mon.comm is None or bool(mon.comm.broken)
            return out  # the peer is dead: the job's own next all-reduce would wait on it, not gradloc
        opt.step()
        opt.zero_grad()
    mon.close()
    return out


def test_a_probe_that_raises_on_one_rank_is_recorded_and_the_job_goes_on_in_lockstep():
    res = run(_job, 2, "raise", timeout_s=240)
    for r in res:
        (step, status, note), = r["notes"]
        assert (step, status) == (SPIKE, "unavailable")
        assert "the probe on rank 1 failed: ValueError: the user's probe closure broke" in note
        assert r["collectives"][SPIKE + 1:] == [1] * (STEPS - SPIKE - 1)  # still one gather a step: in lockstep


def test_a_rank_that_crashes_mid_probe_does_not_hang_the_others():
    res = run(_job, 2, "crash", timeout_s=120, may_die=(1,))
    assert res[1] is None  # rank 1 died
    (step, status, note), = res[0]["notes"]
    assert (step, status) == (SPIKE, "unavailable")
    assert "did not complete within 4 s" in note
    assert res[0]["left_job"]


def _pp_dies(rank, world):
    from tests.distributed.pp_job import train

    return train(rank, world, "toy", "GPipe", STEPS, plant=(0, SPIKE, 2, 7), die=(1, SPIKE), collective_timeout_s=4)


def test_a_pipeline_stage_that_dies_mid_probe_does_not_hang_the_others():
    """The last stage exits inside a probe's loss: the first stage's probe send/recv is waited on with the job's
    deadline, so it leaves with an unavailable localization that names the rank that did not answer."""
    res = run(_pp_dies, 2, timeout_s=180, may_die=(1,))
    assert res[1] is None
    dead = res[0]["dead_peer"]
    assert dead["status"] == "unavailable" and "rank 1" in dead["note"] and "within 4 s" in dead["note"], dead
