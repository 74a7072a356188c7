"""A job's ranks as a grid: model dimensions (tp, pp) × the data index, with one communicator per group.

Ranks that differ only along a **model** dimension (tensor parallel ``tp``, pipeline ``pp``) see the same
tokens: together they are one *token group*, whose per-token scores add up (each holds a slice of the
layers or of their features). Ranks that share every model coordinate and differ in their data form a
*data group*: its size is the job's data-parallel degree ``dp`` (data replicate × shard × expert, all
one index here), and it is the localizer's set of ranks — W = dp, rank = the data index. Every rank of a
token group runs the same localization on the same (summed) view, so their probes, which are
collectives along tp and pp, run in lockstep by construction.

Each rank's model coordinates come from the backends (a DeviceMesh's named dims, a PipelineStage,
Megatron's parallel state). :meth:`Layout.build` gathers them from every rank once, at attach, checks
that they form a full grid (every rank raises the same :class:`AttachError` when they do not: ranks
disagreeing on the mesh never enter collectives the others skip) and creates the groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from gradloc.errors import AttachError
from gradloc.parallel.comm import JobComm

MODEL_DIMS = ("tp", "pp")  # ranks differing only here see the same tokens (cp: not supported, see job.py)


@dataclass
class Layout:
    world: JobComm
    data: JobComm  # ranks with this rank's model coordinates: the localizer's ranks (W = dp)
    token: JobComm | None  # ranks with this rank's data index (same tokens); None when it is this rank alone
    sizes: dict[str, int]  # "dp" and each model dim present: its size
    coord: dict[str, int]  # this rank's coordinate along each of ``sizes``
    groups: dict[str, JobComm] = field(default_factory=dict)  # one communicator per model dim of size > 1
    every: tuple[dict[str, int], ...] = ()  # each world rank's ``coord`` (empty: data parallelism alone)

    @property
    def dp(self) -> int:
        return self.sizes["dp"]

    @property
    def token_size(self) -> int:
        return self.token.world_size if self.token is not None else 1

    def size(self, dim: str) -> int:
        return self.sizes.get(dim, 1)

    @staticmethod
    def build(world: JobComm, model: Mapping[str, tuple[int, int]]) -> "Layout":
        """``model``: this rank's (coordinate, size) along each model dim it has (``tp``, ``pp``)."""
        mine = tuple(sorted((k, int(c), int(s)) for k, (c, s) in model.items() if int(s) > 1))
        every = world.all_gather_object(mine, "gradloc layout")
        dims = {k: s for k, _, s in mine}
        problem = _check(every, world.world_size)
        if problem:
            raise AttachError(f"gradloc: the ranks do not form one parallel grid ({problem}); every rank must "
                              "watch the same model with the same mesh")
        model_of = [tuple((k, c) for k, c, _ in e) for e in every]  # rank -> its model coordinates
        data_groups: dict[tuple, list[int]] = {}
        for r, key in enumerate(model_of):
            data_groups.setdefault(key, []).append(r)
        data_lists = [data_groups[k] for k in sorted(data_groups)]
        index = {r: i for ranks in data_lists for i, r in enumerate(ranks)}  # rank -> its data index
        token_lists = [[r for r in range(world.world_size) if index[r] == i] for i in range(len(data_lists[0]))]
        dp = len(data_lists[0])
        data = _subgroup(world, data_lists, "data")
        token = _subgroup(world, token_lists, "token") if len(token_lists[0]) > 1 else None
        groups = {}
        for k in dims:  # along one model dim: same data index and the same other model coordinates
            rest = [(index[r], tuple(x for x in model_of[r] if x[0] != k)) for r in range(world.world_size)]
            lists: dict[tuple, list[int]] = {}
            for r, key in enumerate(rest):
                lists.setdefault(key, []).append(r)
            groups[k] = _subgroup(world, [lists[key] for key in sorted(lists)], k)
        coord = {k: c for k, c, _ in mine}
        coord["dp"] = index[world.rank]
        every_coord = tuple({**{k: c for k, c, _ in e}, "dp": index[r]} for r, e in enumerate(every))
        return Layout(world, data, token, {"dp": dp, **dims}, coord, groups, every_coord)

    @staticmethod
    def flat(world: JobComm) -> "Layout":
        """Data parallelism alone (DDP, FSDP2, ZeRO over every rank): no new group, nothing gathered."""
        return Layout(world, world, None, {"dp": world.world_size}, {"dp": world.rank}, {})


def _check(every: list[tuple], world: int) -> str:
    """Why the gathered coordinates are not a full grid ('' when they are)."""
    names = {tuple((k, s) for k, _, s in e) for e in every}
    if len(names) > 1:
        return "model dims differ between ranks: " + "; ".join(
            f"rank {r}: {dict((k, s) for k, _, s in e) or 'none'}" for r, e in enumerate(every)
            if tuple((k, s) for k, _, s in e) != tuple((k, s) for k, _, s in every[0]))
    sizes = dict(next(iter(names)))
    cells = 1
    for s in sizes.values():
        cells *= s
    if world % cells:
        return f"{world} ranks do not divide into model groups of {cells} ({sizes})"
    counts: dict[tuple, int] = {}
    for e in every:
        key = tuple((k, c) for k, c, _ in e)
        if any(not 0 <= c < s for _, c, s in e):
            return f"a coordinate outside its dim: {e}"
        counts[key] = counts.get(key, 0) + 1
    if len(counts) != cells or len(set(counts.values())) != 1:
        return f"model coordinates are not spread evenly over the ranks: {counts}"
    return ""


def _subgroup(world: JobComm, lists: list[list[int]], name: str) -> JobComm:
    """This rank's group among ``lists`` (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    if len(lists) == 1 and len(lists[0]) == world.world_size:
        return world.sub(world.group, name) if world.group is not None else JobComm(
            world.rank, world.world_size, world.timeout_s, None, name, world.state)
    mine = None
    for ranks in lists:
        g = dist.new_group(ranks, backend=dist.get_backend(world.group))
        if world.rank in ranks:
            mine = g
    assert mine is not None
    return world.sub(mine, name)


__all__ = ["Layout", "MODEL_DIMS"]
