"""An in-process job of W ranks for the localizer's unit tests: one thread per rank, collectives by
exchange through a barrier (every call has a deadline, so a rank that takes another path fails the
test instead of hanging it). It stands in for ``parallel.comm.JobComm`` (gloo): the decisions under
test are the localizer's, identical whatever carries the bytes; the real collectives are tested by
tests/distributed/."""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

TIMEOUT_S = 60.0


class FakeJob:
    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world, timeout=TIMEOUT_S)
        self._slots: list[Any] = [None] * world
        self.calls: list[list[str]] = [[] for _ in range(world)]  # what each rank asked for, in order

    def comm(self, rank: int) -> "FakeComm":
        return FakeComm(self, rank)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """fn(rank) on every rank at once; the results in rank order (a rank's exception re-raised)."""
        out: list[Any] = [None] * self.world
        errors: list[BaseException | None] = [None] * self.world

        def body(r: int) -> None:
            try:
                torch.set_num_threads(1)
                out[r] = fn(r)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors[r] = exc
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S * 2)
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
        if first is not None:
            raise first
        if any(errors):
            raise errors[0]  # type: ignore[misc]
        return out


class FakeComm:
    def __init__(self, job: FakeJob, rank: int) -> None:
        self.job, self.rank, self.world_size = job, rank, job.world
        self.collectives = 0

    def _exchange(self, obj: Any, what: str) -> list[Any]:
        self.collectives += 1
        self.job.calls[self.rank].append(what)
        self.job._slots[self.rank] = obj
        self.job._barrier.wait()
        got = list(self.job._slots)
        self.job._barrier.wait()
        return got

    def all_gather(self, t: torch.Tensor, what: str = "all_gather") -> torch.Tensor:
        return torch.stack(self._exchange(t.detach().clone(), what))

    def all_reduce(self, t: torch.Tensor, op: str = "sum", what: str = "all_reduce") -> torch.Tensor:
        xs = torch.stack(self._exchange(t.detach().clone(), what))
        return xs.sum(0) if op == "sum" else xs.max(0).values

    def all_reduce_(self, tensors: list[torch.Tensor], what: str = "all_reduce") -> None:
        every = self._exchange([t.detach().clone() for t in tensors], what)
        for i, t in enumerate(tensors):
            t.copy_(sum(e[i] for e in every))

    def all_gather_object(self, obj: Any, what: str = "all_gather_object") -> list[Any]:
        return self._exchange(obj, what)
