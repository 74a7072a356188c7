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


def _tp_dies(rank, world):
    """A tensor-parallel job (tp 2, sequence parallel) whose rank 1 exits in the middle of a probe's forward, at its
    last module (its earlier modules' DTensor collectives done): rank 0 is then in a probe too, lockstep."""
    import gradloc
    from tests.distributed import tp_job

    model, _ = tp_job.build(world, 2, sp=True)
    x, y, w = tp_job.data(0, STEPS)
    w[SPIKE, 1, 2, 5] = 3000.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gradloc.watch(model, opt, store=False, detector=gradloc.DetectorConfig(warmup=5), collective_timeout_s=4)
    probing = []
    last = list(model.modules())[-1]
    last.register_forward_pre_hook(lambda *_: os._exit(3) if probing and rank == 1 else None)
    out = {"notes": []}
    for s in range(STEPS):
        def loss_for(i, mask=None, s=s):
            terms = tp_job.token_losses(model(x[s, i]), y[s, i]) * w[s, i]
            return (terms * mask if mask is not None else terms).sum() / (terms.numel() * x.shape[1])

        def probe(i, mask):
            probing.append(s == SPIKE)
            try:
                return loss_for(i, mask)
            finally:
                probing.clear()

        total = torch.zeros(())
        for i in range(x.shape[1]):
            with mon.micro_batch(y[s, i]):
                loss = loss_for(i)
                loss.backward()
            total += loss.detach()
        rep = mon.end_step(total, probe=probe)
        if rep.incident is not None:
            out["notes"].append((s, str(rep.incident.localization.status), rep.incident.localization.note))
        if s == SPIKE:
            out["left_job"] = mon.comm is None or bool(mon.comm.broken)
            return out  # the peer is dead: the model's own next collective would wait on it, not gradloc's
        opt.step()
        opt.zero_grad()
    return out


def test_a_tensor_parallel_rank_that_dies_mid_probe_forward_does_not_hang_the_other():
    """The dead peer's sockets close, so the next collective the survivor shares with it (here gradloc's probe
    combine; DTensor's inside the forward the same way) fails on the closed connection instead of waiting out a
    timeout; the survivor records an unavailable localization saying so and leaves the job (gradloc's collectives
    off). A peer that hangs, alive, inside the model's own collectives is another matter: those wait for the
    process group's timeout, which gradloc does not set."""
    res = run(_tp_dies, 2, timeout_s=180, may_die=(1,))
    assert res[1] is None
    (step, status, note), = res[0]["notes"]
    assert (step, status) == (SPIKE, "unavailable"), note
    assert "localization failed" in note and "did not complete" in note and res[0]["left_job"]
