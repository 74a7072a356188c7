"""The launcher itself: results by rank, a raising rank fails the test, a deadlock fails it in time."""
from __future__ import annotations

import time

import pytest

from tests.distributed.launch import run


def _sum(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def _raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")


def _deadlock(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 0:
        dist.all_reduce(torch.zeros(1))  # rank 1 never joins: a deadlock
    else:
        time.sleep(600)


def test_results_by_rank():
    assert run(_sum, 2) == [3.0, 3.0]


def test_a_raising_rank_fails_the_test_with_its_traceback():
    with pytest.raises(AssertionError, match="(?s)rank 1 failed:.*boom on rank 1"):
        run(_raises, 2)


def test_a_deadlock_fails_within_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"did not finish within 8 s"):
        run(_deadlock, 2, timeout_s=8)
    assert time.monotonic() - t0 < 30
