"""Ranks that do not agree are caught at attach, with the same error on every rank."""
from __future__ import annotations

from tests.distributed.ddp_job import build
from tests.distributed.launch import run


def _attach(rank, world, differ: str):
    import gradloc

    model = build("ddp")
    kw = {"store": False}
    if differ == "config" and rank == 1:
        kw["top_k"] = 8
    if differ == "layers" and rank == 1:
        kw["layer_grouping"] = 1
    try:
        gradloc.watch(model, **kw).close()
        return "attached"
    except gradloc.AttachError as exc:
        return str(exc)


def test_different_settings_on_one_rank_fail_every_rank():
    for msg in run(_attach, 2, "config", timeout_s=120):
        assert "ranks [1] do not match rank 0" in msg and "top_k" in msg


def test_different_layers_on_one_rank_fail_every_rank():
    for msg in run(_attach, 2, "layers", timeout_s=120):
        assert "ranks [1] do not match rank 0" in msg


def test_matching_ranks_attach():
    assert run(_attach, 2, "none", timeout_s=120) == ["attached", "attached"]


def _layout(rank, world, coords):
    from gradloc.errors import AttachError
    from gradloc.parallel.comm import JobComm
    from gradloc.parallel.layout import Layout

    try:
        lay = Layout.build(JobComm.detect(30.0), coords[rank])
        return ("built", lay.sizes, lay.coord)
    except AttachError as exc:
        return ("error", str(exc))


def test_ranks_that_disagree_on_the_mesh_fail_every_rank_at_attach():
    """Rank 3 believes in a tp dim of 4 where the others see (dp 2, tp 2): the same AttachError on every rank."""
    bad = [{"tp": (0, 2)}, {"tp": (1, 2)}, {"tp": (0, 2)}, {"tp": (3, 4)}]
    for got in run(_layout, 4, bad, timeout_s=120):
        assert got[0] == "error" and "model dims differ" in got[1] and "rank 3" in got[1], got


def test_ranks_that_agree_build_one_grid():
    good = [{"tp": (0, 2)}, {"tp": (1, 2)}, {"tp": (0, 2)}, {"tp": (1, 2)}]
    got = run(_layout, 4, good, timeout_s=120)
    assert [g[2] for g in got] == [{"tp": 0, "dp": 0}, {"tp": 1, "dp": 0}, {"tp": 0, "dp": 1}, {"tp": 1, "dp": 1}]
    assert all(g[1] == {"dp": 2, "tp": 2} for g in got)
