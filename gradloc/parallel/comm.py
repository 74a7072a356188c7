"""gradloc's collectives in a multi-rank job, each under a deadline, over the world or a named group.

A collective entered by some ranks but not others hangs a job forever. gradloc's rule: every rank
takes the same path (decisions come from values that are identical on all ranks), and every
collective it issues is asynchronous and waited on with a timeout (``WatchConfig.collective_timeout_s``).
A rank that crashed, or a peer stuck elsewhere, then turns into a :class:`CollectiveTimeout` that the
caller records (a localization that failed, with the reason) instead of a hang. Objects (per-rank
culprit records) travel as pickled byte tensors: their lengths first, then the padded bytes — two
collectives, both with the deadline.

A job's communicators (``world``, and the named groups of ``parallel/layout.py``: ``data``, ``token``,
``tp``, ``pp``, ``ep``) share one state: one count of collectives issued, and one ``broken`` reason. After
any of them timed out the ranks are out of lockstep, so every one of them refuses to issue more.
"""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gradloc.errors import GradlocError


class CollectiveTimeout(GradlocError, RuntimeError):
    """A gradloc collective did not complete in time (a peer crashed, hung, or took another path)."""


@dataclass
class CommState:
    """What every communicator of one job shares."""

    collectives: int = 0  # issued so far, over every group (the tests count them)
    broken: str = ""  # why gradloc's collectives stopped (a timeout: the ranks are out of lockstep)
    trace: list[tuple[str, str]] | None = None  # when a list: (group, purpose) of each one, in order (tests)


class JobComm:
    """Collectives with a deadline over ``group`` (None: the default group, every rank)."""

    def __init__(self, rank: int, world_size: int, timeout_s: float = 60.0, group: Any = None,
                 name: str = "world", state: CommState | None = None) -> None:
        self.rank, self.world_size, self.timeout_s, self.group, self.name = rank, world_size, timeout_s, group, name
        self.state = state if state is not None else CommState()

    @property
    def collectives(self) -> int:
        return self.state.collectives

    @property
    def broken(self) -> str:
        return self.state.broken

    @staticmethod
    def detect(timeout_s: float) -> "JobComm | None":
        """The initialised default process group, when the job has more than one rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return JobComm(dist.get_rank(), dist.get_world_size(), timeout_s)

    def sub(self, group: Any, name: str) -> "JobComm":
        """A communicator over ``group`` (a process group this rank belongs to) sharing this one's state."""
        import torch.distributed as dist

        return JobComm(dist.get_rank(group), dist.get_world_size(group), self.timeout_s, group, name, self.state)

    @property
    def device(self) -> torch.device:
        """Where this group's tensors must live (gloo: the CPU; NCCL: this rank's GPU)."""
        import torch.distributed as dist

        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def _wait(self, work: Any, what: str, traced: bool = True) -> None:
        self.state.collectives += 1
        if traced and self.state.trace is not None:
            self.state.trace.append((self.name, what))
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            # After a collective that did not complete, the ranks' next collectives would pair up
            # wrongly: gradloc issues none for the rest of the run (Monitor falls back to per-rank).
            self.state.broken = (f"{what} on rank {self.rank} of {self.name} did not complete within "
                                 f"{self.timeout_s:g} s (a rank crashed, hangs, or took another path): {exc}")
            raise CollectiveTimeout(self.state.broken) from exc

    def wait_p2p(self, work: Any, peer: int, what: str) -> None:
        """Wait on a point-to-point ``work`` (a pipeline probe's send/recv with rank ``peer``) under the deadline;
        past it, gradloc's collectives are off (the ranks are out of lockstep) and the peer is named."""
        self._check()
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            self.state.broken = (f"{what} did not complete within {self.timeout_s:g} s on rank {self.rank} "
                                 f"(rank {peer} crashed, hangs, or took another path): {exc}")
            raise CollectiveTimeout(self.state.broken) from exc

    def _check(self) -> None:
        if self.state.broken:
            raise CollectiveTimeout(f"gradloc's collectives are off after an earlier failure: {self.state.broken}")

    def all_gather(self, t: torch.Tensor, what: str = "all_gather") -> torch.Tensor:
        """(W, *t.shape): every rank's ``t``, in rank order, on ``t``'s device."""
        self._check()
        import torch.distributed as dist

        src = t.detach().contiguous().to(self.device)
        flat = torch.empty(self.world_size * src.numel(), dtype=src.dtype, device=src.device)  # gloo: concatenated
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        self._wait(gather(flat, src.reshape(-1), group=self.group, async_op=True), what)
        return flat.reshape(self.world_size, *src.shape).to(t.device)  # (W·n,) -> (W, *shape)

    def all_reduce(self, t: torch.Tensor, op: str = "sum", what: str = "all_reduce") -> torch.Tensor:
        """The reduction of every rank's ``t`` (a new tensor on ``t``'s device)."""
        self._check()
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        buf = t.detach().clone().to(self.device)
        self._wait(dist.all_reduce(buf, op=ops[op], group=self.group, async_op=True), what)
        return buf.to(t.device)

    def all_reduce_(self, tensors: list[torch.Tensor], what: str = "all_reduce") -> None:
        """In-place SUM of each tensor over ranks (gradients: one collective per tensor, all in flight)."""
        self._check()
        import torch.distributed as dist

        works = [(t, dist.all_reduce(t, group=self.group, async_op=True)) for t in tensors]
        if self.state.trace is not None:  # one call, however many tensors (the count differs between groups)
            self.state.trace.append((self.name, what))
        for _, w in works:
            self._wait(w, what, traced=False)

    def all_to_all(self, t: torch.Tensor, send: Sequence[int], recv: Sequence[int],
                   what: str = "all_to_all") -> torch.Tensor:
        """Rows of ``t`` (dim 0) scattered to the ranks in ``send`` counts; the rows received, ``recv`` counts."""
        self._check()
        import torch.distributed as dist

        src = t.detach().contiguous().to(self.device)
        out = torch.empty((int(sum(recv)), *src.shape[1:]), dtype=src.dtype, device=src.device)
        self._wait(dist.all_to_all_single(out, src, [int(n) for n in recv], [int(n) for n in send],
                                          group=self.group, async_op=True), what)
        return out.to(t.device)

    def all_gather_object(self, obj: Any, what: str = "all_gather_object") -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.all_gather(torch.tensor([data.numel()], dtype=torch.long), what + " (sizes)")
        pad = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        pad[: data.numel()] = data
        blobs = self.all_gather(pad, what)
        return [pickle.loads(blobs[r, : int(sizes[r])].numpy().tobytes()) for r in range(self.world_size)]


__all__ = ["CollectiveTimeout", "CommState", "JobComm"]
