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
