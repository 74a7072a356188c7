"""gradloc's collectives in a multi-rank job, each under a deadline.

A collective entered by some ranks but not others hangs a job forever. gradloc's rule: every rank
takes the same path (decisions come from values that are identical on all ranks, see
``adapters/dist_step.py``), and every collective it issues is asynchronous and waited on with a
timeout (``WatchConfig.collective_timeout_s``). A rank that crashed, or a peer stuck elsewhere,
then turns into a :class:`CollectiveTimeout` that the caller records (a localization that failed,
with the reason) instead of a hang. Objects (per-rank culprit records) travel as pickled byte
tensors: their lengths first, then the padded bytes — two collectives, both with the deadline.
"""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from gradloc.errors import GradlocError


class CollectiveTimeout(GradlocError, RuntimeError):
    """A gradloc collective did not complete in time (a peer crashed, hung, or took another path)."""


@dataclass
class JobComm:
    rank: int
    world_size: int
    timeout_s: float = 60.0
    group: Any = None  # None: the default process group
    collectives: int = 0  # issued so far (the tests count them)
    broken: str = ""  # why gradloc's collectives stopped (a timeout: the ranks are out of lockstep)

    @staticmethod
    def detect(timeout_s: float) -> "JobComm | None":
        """The initialised default process group, when the job has more than one rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return JobComm(dist.get_rank(), dist.get_world_size(), timeout_s)

    @property
    def device(self) -> torch.device:
        """Where this group's tensors must live (gloo: the CPU; NCCL: this rank's GPU)."""
        import torch.distributed as dist

        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def _wait(self, work: Any, what: str) -> None:
        self.collectives += 1
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            # After a collective that did not complete, the ranks' next collectives would pair up
            # wrongly: gradloc issues none for the rest of the run (Monitor falls back to per-rank).
            self.broken = (f"{what} on rank {self.rank} did not complete within {self.timeout_s:g} s "
                           f"(a rank crashed, hangs, or took another path): {exc}")
            raise CollectiveTimeout(self.broken) from exc

    def _check(self) -> None:
        if self.broken:
            raise CollectiveTimeout(f"gradloc's collectives are off after an earlier failure: {self.broken}")

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
        for _, w in works:
            self._wait(w, what)

    def all_gather_object(self, obj: Any, what: str = "all_gather_object") -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.all_gather(torch.tensor([data.numel()], dtype=torch.long), what + " (sizes)")
        pad = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        pad[: data.numel()] = data
        blobs = self.all_gather(pad, what)
        return [pickle.loads(blobs[r, : int(sizes[r])].numpy().tobytes()) for r in range(self.world_size)]
