"""Test helpers for docs/ARCHITECTURE.md's invariants inside a rank: a trace of gradloc's collectives, and a
count of the device-to-host copies a step forces (every Tensor method that forces one, as
tests/collector/test_host_transfers.py counts them)."""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Iterator

import torch

SYNCING = ("cpu", "item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def count_syncs() -> Iterator[Counter]:
    counts: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrap(name: str, original: Any) -> Any:
        def wrapper(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            counts[name] += 1
            return original(self, *a, **k)
        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class Watch:
    """Around each ``end_step``: the collectives it issued (group, purpose) and the copies it forced."""

    def __init__(self, mon: Any) -> None:
        self.mon = mon
        mon.comm.state.trace = []
        self.steps: list[dict] = []

    def end_step(self, *args: Any, **kwargs: Any) -> Any:
        trace = self.mon.comm.state.trace
        start = len(trace)
        with count_syncs() as syncs:
            rep = self.mon.end_step(*args, **kwargs)
        self.steps.append({"trace": list(trace[start:]), "syncs": dict(syncs), "spike": rep.incident is not None})
        return rep
