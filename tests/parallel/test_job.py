"""The job's layer list over pipeline stages and the placements no backend claims (parallel/job.py)."""
from __future__ import annotations

from types import SimpleNamespace

from gradloc.config import WatchConfig
from gradloc.parallel.data import FSDP, Alone
from gradloc.parallel.global_layers import global_layers
from gradloc.parallel.job import Job
from gradloc.parallel.layout import _check


def _rank(stage: int, layers: list[str], tokens: list[str]) -> tuple:
    return ((("dp", 0), ("pp", stage)), tuple(layers), tuple(range(1, len(layers) + 1)), tuple(tokens), {}, None)


def test_every_stage_s_layers_in_stage_order_and_shared_names_qualified():
    every = [_rank(1, ["layers.0.w", "head"], ["layers.0.w", "head"]), _rank(0, ["emb", "layers.0.w"], ["emb", "layers.0.w"])]
    g = global_layers(every, 0)
    assert g.names == ("emb", "stage0.layers.0.w", "stage1.layers.0.w", "head")
    assert g.index == (2, 3) and g.token_index == (2, 3)  # rank 0 is stage 1
    assert global_layers(every, 1).index == (0, 1)


def test_the_grid_check_names_what_is_wrong():
    tp2 = lambda c: (("tp", c, 2),)  # noqa: E731
    assert _check([tp2(0), tp2(1), tp2(0), tp2(1)], 4) == ""
    assert "differ" in _check([tp2(0), tp2(1), (("tp", 0, 4),), tp2(1)], 4)
    assert "not spread evenly" in _check([tp2(0), tp2(0), tp2(0), tp2(1)], 4)
    assert "do not divide" in _check([(("tp", 0, 3),)] * 4, 4)


class _Placement:
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def is_replicate(self) -> bool:
        return self.kind == "R"

    def __repr__(self) -> str:
        return self.kind


def _param(names, placements):  # noqa: ANN001, ANN202
    mesh = SimpleNamespace(mesh_dim_names=names, ndim=len(placements))
    return SimpleNamespace(placements=tuple(_Placement(p) for p in placements), device_mesh=mesh)


def test_a_split_along_a_mesh_dim_no_backend_claims_is_named():
    fsdp = Job(None, None, WatchConfig(), None, FSDP())
    assert fsdp.unclaimed_dims([("a", _param(("dp_shard", "tp"), ("S", "R")))]) == ""
    assert "'cp'" in fsdp.unclaimed_dims([("a", _param(("dp", "cp"), ("S", "S")))])
    assert "'tp'" in fsdp.unclaimed_dims([("a", _param(("dp", "tp"), ("S", "S")))])  # no TP backend in this job
    assert "mesh dim 'x'" in Job(None, None, WatchConfig(), None, Alone()).unclaimed_dims([("a", _param(("x",), ("S",)))])
