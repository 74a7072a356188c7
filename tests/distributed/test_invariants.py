"""docs/ARCHITECTURE.md's invariants, held on four jobs of different backends: TP with sequence parallelism (2
processes), 2D FSDP2 × TP with it (4), pipeline parallel × FSDP2 (4), and torchtitan's expert parallelism (2).

- every rank takes the same path: one trace of gradloc's collectives (group and purpose, in order) on every
  rank, through healthy steps and a spike with probes;
- one device-to-host copy per healthy step (the packed transfer: ``.cpu()`` then ``.numpy()`` of the copy);
- the documented number of collectives per healthy step.
"""
from __future__ import annotations

import pytest

from tests import titan
from tests.distributed.launch import run

STEPS, AT = 7, 6


def _tp(rank: int, world: int) -> dict:
    from tests.distributed.tp_job import train

    return train(rank, world, 2, True, STEPS, plant=(1, AT, 0, 3, 9), invariants=True)


def _tp_alone(rank: int, world: int) -> dict:
    from tests.distributed.tp_job import train

    return train(rank, world, 2, True, STEPS, plant=(0, AT, 0, 3, 9), invariants=True)


def _pp(rank: int, world: int) -> dict:
    from tests.distributed.pp_job import train

    return train(rank, world, "toy", "GPipe", STEPS, plant=(1, AT, 2, 7), invariants=True)


def _ep(rank: int, world: int, kind: str = "ep") -> dict:
    from tests.distributed.titan_job import train

    return train(rank, world, kind, STEPS, plant=(1, AT, 1, 1, 4), invariants=True)


def _ep_dsv3(rank: int, world: int) -> dict:
    return _ep(rank, world, "ep-dsv3")


# per healthy step: the step gather, + the token group's scores, + the Partial norms' sum (SP), + the experts' home
# (under FSDP2 × TP the SP norms' gradients come out of FSDP's reduction sharded, not Partial: no third one)
CASES = [("tp-sp", _tp_alone, 2, ["step", "token", "partial"]), ("fsdp-tp-sp", _tp, 4, ["step", "token"]),
         ("pp-fsdp", _pp, 4, ["step", "token"]),
         ("ep", _ep, 2, ["step", "experts"]), ("ep-dsv3", _ep_dsv3, 2, ["step", "experts"])]


@pytest.mark.parametrize("name,job,world,expected", CASES, ids=[c[0] for c in CASES])
def test_one_path_one_transfer_and_the_documented_collectives(name, job, world, expected):
    if name.startswith("ep") and not titan.HAS_TITAN:
        pytest.skip("needs torchtitan (the titan extra)")
    results = run(job, world, timeout_s=600)
    traces = [r["trace"] for r in results]
    for r, t in enumerate(traces):
        first = next((i for i, (a, b) in enumerate(zip(t, traces[0])) if a != b), min(len(t), len(traces[0])))
        assert t == traces[0], f"rank {r} took another path at collective {first}: {t[first - 2:first + 3]} vs " \
                               f"rank 0's {traces[0][first - 2:first + 3]} ({len(t)} vs {len(traces[0])})"
    assert any(s["spike"] for s in results[0]["steps"])  # the trace covers a spike with probes too
    for r in results:
        healthy = [s for s in r["steps"] if not s["spike"]]
        assert len(healthy) == STEPS - 1
        for s in healthy:
            assert s["syncs"] == {"cpu": 1, "numpy": 1}, s["syncs"]
            assert len(s["trace"]) == len(expected), s["trace"]
