"""The defaults tier's checks on a run of tests/defaults/ddp_job.py's loop (DDP, FSDP2, HSDP): the same
assertions for every wrapper, so that a new one is held to exactly what DDP is held to."""
from __future__ import annotations

import pytest

from tests.defaults.ddp_job import HEALTHY, PLANT, STEPS

DEADLINE_S = 60.0  # WatchConfig.collective_timeout_s's default


def norms_location_and_deadline(ranks: list[dict], variant: str, kind: str) -> None:
    """On every rank: the job kind, gradloc's norm equal (rel 1e-5) to the whole gradient the optimizer sees and
    to ``clip_grad_norm_``'s return value on every step; one job incident, at the planted step, located on the last
    (data) rank at the planted token in ≤ 3 probes, its share measured against the job's gradient; no collective
    deadline hit (communicators intact, the spike step well inside the deadline); one answer on every rank."""
    world = len(ranks)
    for rank, res in enumerate(ranks):
        w = res[variant]["with"]
        assert w["kind"] == kind and w["broken"] == "", (rank, w["kind"], w["broken"])
        assert len(w["steps"]) == STEPS
        for s, st in enumerate(w["steps"]):
            assert st["norm"] == pytest.approx(st["delivered"], rel=1e-5), (rank, s)
            assert st["norm"] == pytest.approx(st["clip"], rel=1e-5), (rank, s)
        assert [s for s, st in enumerate(w["steps"]) if st["incident"]] == [HEALTHY], rank
        spike = w["steps"][HEALTHY]
        loc = spike["loc"]
        assert spike["scope"] == "job", spike["scope"]  # the job's incident, not one rank's
        assert loc["status"] == "located" and 1 <= loc["probes"] <= 3, loc["note"]
        assert loc["culprits"][0] == (world - 1, *PLANT[1:]), loc["culprits"]
        assert {c[0] for c in loc["culprits"]} == {world - 1}
        assert 0.9 < loc["explained"] < 1.1, loc["explained"]
        assert spike["seconds"] < DEADLINE_S / 2, spike["seconds"]  # no rank waited on a collective deadline
    assert len({repr(r[variant]["with"]["steps"][HEALTHY]["loc"]) for r in ranks}) == 1  # one answer, every rank


def bitwise(ranks: list[dict], variant: str) -> None:
    """Every rank's parameters after training bitwise those of the same run without gradloc."""
    import torch

    for rank, res in enumerate(ranks):
        with_mon, without = res[variant]["with"]["params"], res[variant]["without"]["params"]
        assert with_mon.keys() == without.keys()
        for name, p in without.items():
            assert torch.equal(p, with_mon[name]), f"{variant}, rank {rank}: {name} differs"
