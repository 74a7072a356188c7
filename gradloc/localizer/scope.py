"""What the localizer needs from the ranks it runs on: a communicator and a probe scope.

One :class:`~gradloc.localizer.localizer.Localizer` serves a single process and a job of W ranks
alike: a single process is W = 1 (:class:`SoloScope`, whose collectives are the identity). A scope
owns what differs between parallelisms (``parallel/scope.py`` holds the job's):

- ``comm``: the collectives every rank enters together (all-gather of a fixed-size tensor or of a
  picklable object, all-reduce); ``parallel.comm.JobComm`` puts a deadline on each;
- ``session(hooks=False)``: a probe session in whatever context the probes need (DDP: ``no_sync``);
  ``hooks=True`` leaves the per-token hooks running (``token_stats="on_spike"`` re-runs a flagged step's
  micro-batches through it: every probe of a step, and its re-run, goes through the one scope);
- ``lockstep``: every rank must take part in every probe (FSDP2, ZeRO-3: a probe's forward gathers
  parameters), with an all-false token mask when it has nothing to probe;
- ``measure(acc, loss, error)``: the job's ⟨∇_C, ∇⟩ / ‖∇‖² and ℓ_C of the probe gradients ``acc``
  (this rank's probes, accumulated in place); ``linear`` scopes keep ``acc`` as it was, so later
  probes may keep accumulating into it and ``measure`` gives totals; the others (DDP, ZeRO) turn it
  into the job's gradient (summed over ranks and averaged), so a later probe goes into a fresh
  buffer whose measure is a delta. ``error``: this rank's probe failure, every rank learns it;
- ``norms(acc)``: (‖∇_C‖, ‖∇ − ∇_C‖) of a measured ``acc``;
- ``decomposes``/``contribution``: whether the decomposition probe runs on the rank that holds a
  micro-batch (its stored gradient is the job's, whole), and the factor its results enter the job
  with (DDP averages over the W ranks: 1/W).

Every rank takes the same path: the localizer's decisions come only from gathered values.
"""
from __future__ import annotations

import math
from typing import Any, Callable, ContextManager, Protocol

import torch

from gradloc.localizer.probes import Grads, ProbeSession, distance, dot, grad_norm


class ProbeFailed(RuntimeError):
    """A probe raised on some rank; every rank learned it in the same collective."""


class Comm(Protocol):
    rank: int
    world_size: int

    def all_gather(self, t: torch.Tensor, what: str = "all_gather") -> torch.Tensor: ...

    def all_reduce(self, t: torch.Tensor, op: str = "sum", what: str = "all_reduce") -> torch.Tensor: ...

    def all_gather_object(self, obj: Any, what: str = "all_gather_object") -> list[Any]: ...


class SoloComm:
    """W = 1: every collective is the identity."""

    rank, world_size = 0, 1

    def all_gather(self, t: torch.Tensor, what: str = "") -> torch.Tensor:
        return t.detach().clone().unsqueeze(0)  # (*shape) -> (1, *shape)

    def all_reduce(self, t: torch.Tensor, op: str = "sum", what: str = "") -> torch.Tensor:
        return t.detach().clone()

    def all_gather_object(self, obj: Any, what: str = "") -> list[Any]:
        return [obj]


class Scope(Protocol):
    comm: Comm
    lockstep: bool
    linear: bool
    decomposes: bool  # this scope can run the decomposition probe (stored gradients whole on the owner rank)
    contribution: float  # the factor a rank's own probe gradient (and loss) enters the job's with (DDP: 1/W)
    job: bool  # a job's rank (records name their rank), not one process

    def session(self, hooks: bool = False) -> ContextManager[ProbeSession]: ...

    def measure(self, acc: Grads, loss: float, error: str) -> tuple[float, float]: ...

    def norms(self, acc: Grads) -> tuple[float, float]: ...


Opener = Callable[[bool], ContextManager[ProbeSession]]  # hooks -> a probe session (``Scope.session``)


class SoloScope:
    """One process: probes through ``opener``, shares against the stored gradient."""

    lockstep, linear, decomposes, contribution, job = False, True, True, 1.0, False

    def __init__(self, opener: Opener, grads: Grads, inv_scale: float, norm: float) -> None:
        self.comm: Comm = SoloComm()
        self._opener, self.grads, self.inv_scale, self.norm = opener, grads, inv_scale, norm

    def session(self, hooks: bool = False) -> ContextManager[ProbeSession]:
        return self._opener(hooks)

    def measure(self, acc: Grads, loss: float, error: str) -> tuple[float, float]:
        if error:
            raise ProbeFailed(error)
        total_sq = self.norm ** 2
        return (dot(acc, self.grads, self.inv_scale) / total_sq if total_sq > 0 else math.nan), loss

    def norms(self, acc: Grads) -> tuple[float, float]:
        """‖∇_C‖ and ‖∇ − ∇_C‖, the latter directly (from ‖∇‖² − 2⟨∇_C, ∇⟩ + ‖∇_C‖² it would cancel
        when the culprits dominate)."""
        return grad_norm(acc), distance(self.grads, acc, self.inv_scale)


def solo_scope(opener: Opener | None, grads: Grads, inv_scale: float, norm: float) -> SoloScope | None:
    """One process's scope over its stored gradient; None without a probe closure (``opener`` None)."""
    return SoloScope(opener, grads, inv_scale, norm) if opener is not None else None
