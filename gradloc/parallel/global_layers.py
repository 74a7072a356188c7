"""What :meth:`~gradloc.parallel.job.Job.setup` derives from its one gather of every rank's (coordinates, layer
names, layer sizes, token layers, settings): the checks that every rank watches what its data group watches with
the same settings (:func:`check_ranks`), and the job's layer list, the same on every rank (:func:`global_layers`)."""
from __future__ import annotations

from dataclasses import dataclass

from gradloc.errors import AttachError
from gradloc.parallel.layout import Layout


@dataclass(frozen=True)
class GlobalLayers:
    """The job's layer list (identical on every rank) and where this rank's own layers sit in it."""

    names: tuple[str, ...]
    numel: tuple[int, ...]
    index: tuple[int, ...]  # this rank's layer i -> its global index
    token_names: tuple[str, ...]
    token_index: tuple[int, ...]  # this rank's token layer i -> its global index


def check_ranks(every: list[tuple], layout: Layout) -> None:
    """Same settings on every rank; same layers across each data group (rank r vs its group's first)."""
    base = every[0][4]
    diff = sorted(k for k in base if any(e[4].get(k) != base.get(k) for e in every))
    if diff:
        bad = [r for r, e in enumerate(every) if e[4] != base]
        raise AttachError(f"gradloc: ranks {bad} do not match rank 0 (settings differ: {diff}); every rank must "
                          "watch the same model with the same WatchConfig")
    first: dict[tuple, int] = {}
    bad = []
    for r, e in enumerate(every):
        model_coord = tuple((k, c) for k, c in e[0] if k != "dp")
        f = first.setdefault(model_coord, r)
        if (e[1], e[3]) != (every[f][1], every[f][3]):
            bad.append((r, f))
    if bad:
        what = ", ".join(f"rank {r}: {len(every[r][1])} layers / {len(every[r][3])} token layers vs rank {f}: "
                         f"{len(every[f][1])} / {len(every[f][3])}" for r, f in bad)
        raise AttachError(f"gradloc: ranks {[r for r, _ in bad]} do not match their data group (the watched layers "
                          f"differ: {what}); every rank must watch the same model with the same WatchConfig")


def global_layers(every: list[tuple], rank: int) -> GlobalLayers:
    """Layers of every pipeline stage in stage order (one stage: this rank's own), the same on every rank. A
    name two stages both use (each stage's module numbering its blocks from 0) is two layers: ``stage{s}.name``."""
    stage_of = [dict(e[0]).get("pp", 0) for e in every]
    owners: dict[str, set[int]] = {}
    for e, st in zip(every, stage_of):
        for n in (*e[1], *e[3]):
            owners.setdefault(n, set()).add(st)

    def named(n: str, st: int) -> str:
        return f"stage{st}.{n}" if len(owners[n]) > 1 else n

    names: dict[str, int] = {}
    tokens: dict[str, None] = {}
    for r in sorted(range(len(every)), key=lambda r: stage_of[r]):  # a stable sort: rank order within a stage
        for n, k in zip(every[r][1], every[r][2]):
            names.setdefault(named(n, stage_of[r]), k)
        for t in every[r][3]:
            tokens.setdefault(named(t, stage_of[r]), None)
    order = {n: i for i, n in enumerate(names)}
    t_order = {n: i for i, n in enumerate(tokens)}
    mine, st = every[rank], stage_of[rank]
    return GlobalLayers(tuple(names), tuple(names.values()), tuple(order[named(n, st)] for n in mine[1]),
                        tuple(tokens), tuple(t_order[named(t, st)] for t in mine[3]))


__all__ = ["GlobalLayers", "check_ranks", "global_layers"]
