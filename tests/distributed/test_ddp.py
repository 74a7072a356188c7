"""DDP on gloo: global norms, one incident naming the rank, probes on the owning rank, training unchanged."""
from __future__ import annotations

import pytest
import torch

from tests.distributed.ddp_job import train
from tests.distributed.launch import run

STEPS, SPIKE = 8, 7


def _ddp(rank, world, plant, monitor):
    out = train(rank, world, "ddp", STEPS, plant, monitor)
    return {"params": out["params"], "collectives": out["collectives"], "kind": out["kind"],
            "reports": [(r.record.global_norm, r.record.layers_global, r.spike.kinds,
                         r.incident.localization if r.incident else None, r.incident.scope if r.incident else None)
                        for r in out["reports"]]}


@pytest.mark.parametrize("world", [2, 4])
def test_a_culprit_on_rank_1_is_found_by_every_rank_as_one_job_incident(world):
    plant = (1, SPIKE, 1, 2, 5)
    res = run(_ddp, world, plant, True, timeout_s=300)
    assert all(r["kind"] == "ddp" for r in res)
    for s in range(STEPS):  # every rank sees the job's norm and the same verdict
        norms = {r["reports"][s][0] for r in res}
        assert len(norms) == 1, (s, norms)
        assert len({r["reports"][s][2] for r in res}) == 1
        assert all(r["reports"][s][1] for r in res)  # layers_global
    for r in res:
        assert r["collectives"][:SPIKE] == [1] * SPIKE  # one all_gather per healthy step, nothing else
        norm, _, kinds, loc, scope = r["reports"][SPIKE]
        assert "grad_spike" in kinds and scope == "job"
        assert loc.status == "located" and loc.probes <= 3, loc.note
        assert [(c.rank, c.micro_batch, c.sample, c.position) for c in loc.culprits] == [plant[:1] + plant[2:]]
        assert loc.explained_share > 0.9
    locs = [r["reports"][SPIKE][3] for r in res]
    assert all(repr(loc) == repr(locs[0]) for loc in locs)  # the same localization on every rank


def test_training_is_bitwise_identical_with_and_without_gradloc():
    plant = (1, SPIKE, 1, 2, 5)
    with_mon = run(_ddp, 2, plant, True, timeout_s=300)
    without = run(_ddp, 2, plant, False, timeout_s=300)
    for r in range(2):
        for name, p in without[r]["params"].items():
            assert torch.equal(p, with_mon[r]["params"][name]), f"rank {r}: {name} differs"


def _padded(rank, world, kind):
    out = train(rank, world, kind, STEPS, pad=(1, SPIKE))
    return [(r.spike.kinds, r.incident.localization if r.incident else None) for r in out["reports"]]


@pytest.mark.parametrize("kind,world", [("ddp", 2), ("ddp", 4), ("fsdp", 2)])
def test_a_rank_whose_loader_emits_padding_is_named_at_the_rank_level(kind, world):
    """A real data fault on one rank: at the spike step rank 1's loader emits rows of padding with their
    labels in the loss (ddp_job.train's ``pad``). No token, sample or micro-batch of it carries the
    spike alone (8 samples, each ~1/8 of the rank's share); the rank does, in ≤ 3 probes, the same on
    every rank. DDP W = 2: its first micro-batch decomposed, then the rank probed; W = 4: that
    micro-batch passes alone but the step would still spike without it, so the rank is probed; FSDP2
    (no decomposition, lockstep probes): one sample probed, then the rank."""
    res = run(_padded, world, kind, timeout_s=300)
    locs = [r[SPIKE][1] for r in res]
    assert all(repr(loc) == repr(locs[0]) for loc in locs)
    loc = locs[0]
    assert all(r[s][1] is None for r in res for s in range(SPIKE))  # nothing before the fault
    assert (loc.status, loc.level) == ("located", "rank"), loc.note
    (group,) = loc.groups
    assert (group.rank, group.micro_batch, group.micro_batches, group.samples, group.tokens) == (1, None, 2, 8, 128)
    assert loc.probes <= 3 and loc.explained_share == group.share > 0.75
    assert loc.culprits == () and loc.spans == ()
    assert all(s.rank == 1 for s in loc.samples if s.share is not None)  # the measured samples are rank 1's


def _agree(rank, world):
    import gradloc
    from tests.distributed.ddp_job import build

    model = build("ddp")
    mon = gradloc.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), store=False)
    try:
        before = mon.comm.collectives
        got = [mon.detector.agree(rank == 1), mon.detector.agree(False)]
        return got, mon.comm.collectives - before
    finally:
        mon.close()


def test_the_sample_spike_verdict_is_the_job_s_through_one_all_reduce():
    """A job's detector asks whether any rank holds a surprise outlier through the real JobComm (gloo):
    rank 1's flag reaches rank 0, one collective per question (tests/detector/test_sensitivity.py has
    the rule itself)."""
    res = run(_agree, 2, timeout_s=120)
    assert res == [([True, False], 2), ([True, False], 2)]


def _lazy(rank, world):
    out = train(rank, world, "ddp", STEPS, (1, SPIKE, 1, 2, 5), token_stats="on_spike")
    return [(r.record.tokens, r.incident.localization if r.incident else None) for r in out["reports"]], out["params"]


def test_on_spike_re_runs_each_rank_s_micro_batches_and_names_the_culprit():
    """token_stats='on_spike' under DDP: no per-token statistics on healthy steps; at the spike every rank
    re-runs its own micro-batches (in no_sync) and the job localizes as with the hooks always on."""
    res = run(_lazy, 2, timeout_s=300)
    always = run(_ddp, 2, (1, SPIKE, 1, 2, 5), True, timeout_s=300)
    for (reports, params), ref in zip(res, always):
        assert all(tokens is None for tokens, _ in reports)
        loc = reports[SPIKE][1]
        assert loc.status == "located" and loc.probes <= 3, loc.note
        assert [(c.rank, c.micro_batch, c.sample, c.position) for c in loc.culprits] == [(1, 1, 2, 5)]
        assert "re-run" in loc.note and loc.passes >= 2
        for name, p in ref["params"].items():
            assert torch.equal(p, params[name]), name
