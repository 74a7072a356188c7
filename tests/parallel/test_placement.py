"""Replica weights from every rank's parameter slices (parallel/placement.py), on in-process ranks."""
from __future__ import annotations

import pytest

from gradloc.errors import AttachError
from gradloc.parallel.placement import replica_weights
from tests.localizer.fake_comm import FakeJob


def _weights(keys_by_rank: list[list[tuple]]) -> list[list[float]]:
    job = FakeJob(len(keys_by_rank))
    return job.run(lambda r: replica_weights(keys_by_rank[r], job.comm(r)))


def test_replicas_count_once_and_shards_add_up():
    whole = ("norm.weight", (8,), (0,), (8,))  # replicated on both ranks (DDP, a norm left whole under TP)
    top, bottom = ("w", (8, 4), (0, 0), (4, 4)), ("w", (8, 4), (4, 0), (4, 4))  # two row shards
    got = _weights([[whole, top], [whole, bottom]])
    assert got == [[0.5, 1.0], [0.5, 1.0]]


def test_a_shard_replicated_over_a_second_dim_counts_once():
    """2D: a row shard held by two tp ranks of each data index (Shard on dp, Replicate on tp)."""
    a, b = ("n", (8,), (0,), (4,)), ("n", (8,), (4,), (4,))
    assert _weights([[a], [a], [b], [b]]) == [[0.5]] * 4


def test_slices_that_overlap_without_being_equal_are_refused_on_every_rank():
    a, b = ("w", (8,), (0,), (6,)), ("w", (8,), (4,), (4,))
    with pytest.raises(AttachError, match="overlap without being equal"):
        _weights([[a], [b]])
