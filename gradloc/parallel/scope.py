"""The localizer's scope for a job (``localizer/scope.py`` has the contract; the algorithm is the one
``Localizer``): how a probe runs and how its gradient and loss combine, whatever the parallelisms.

- The localizer's own collectives (candidates, records, decisions) run over the **data group**: its
  ranks are the job's data-parallel ranks. The ranks of a token group (tp, pp) hold the same summed
  view, take the same decisions and so run every probe together — the probes' TP/PP collectives pair
  up by construction.
- A probe's gradient combines over the data group as the data backend says (DDP: summed and averaged,
  one all-reduce per tensor; FSDP2: the reduce-scatter did it; ZeRO: :class:`ZeroScope`).
- ⟨∇_C, ∇⟩, ‖∇_C‖², ‖∇ − ∇_C‖² and ℓ_C are world-wide sums of per-rank terms, each parameter's term
  times its replica weight (``parallel/placement.py``) and each rank's loss times its loss weight (a
  loss is counted once per data index: 1/tp on the stage that computes it, 0 on the others): one
  all-reduce each. DTensor gradients that are Partial are summed over their group first.

Every collective has the job's deadline (``JobComm``).
"""
from __future__ import annotations

import math
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from gradloc.collector.layer_stats import local
from gradloc.localizer.probes import Grads, ProbeFn, ProbeSession, grad_norm
from gradloc.localizer.scope import Opener, ProbeFailed


class JobScope:
    """A job's probe scope. The keyword ``job`` is the rank's ``parallel.job.Job``, typed ``Any`` here: job.py imports
    the backends, whose ``scope`` builds this (no import cycle)."""

    job = True

    def __init__(self, *, job: Any, params: list[nn.Parameter], metas: Any, probe: ProbeFn,
                 pause_hooks: Callable[[bool], None], grads: Grads, inv_scale: float, norm: float,
                 session: Callable[..., ProbeSession] = ProbeSession, view: Any = None,
                 loss_weight: float = 1.0) -> None:
        self.jb, self.params = job, params
        self.open = opener(job, params, metas, probe, pause_hooks, session)
        layout = job.layout
        self.comm, self.world = layout.data, layout.world
        self.lockstep, self.linear = job.lockstep, job.data.linear
        self.decomposes = job.data.decomposes and not job.parts
        self.contribution = job.data.contribution(layout.dp)
        self.inv_scale, self.norm = inv_scale, norm
        self.base = job.weights if job.weights is not None else [1.0 / layout.world.world_size] * len(params)
        self.view, self.loss_weight = view, loss_weight
        self.grads, self.weights = self.reduce(list(grads))  # the stored gradient's local values, their weights

    def reduce(self, grads: Grads) -> tuple[Grads, list[float]]:
        """Local values (DTensor Partial placements summed) and each one's weight in a world-wide sum."""
        if self.view is None:
            return [None if g is None else local(g) for g in grads], self.base
        vals, factors = self.view(grads, self.params)
        return vals, [w * f for w, f in zip(self.base, factors)]

    def session(self, hooks: bool = False) -> ContextManager[ProbeSession]:
        return self.open(hooks)

    def _raise_failed(self, error: str) -> None:
        errors = self.comm.all_gather_object(error, "gradloc probe errors")
        raise ProbeFailed("; ".join(e for e in errors if e))

    def _sums(self, *parts: float, what: str) -> list[float]:
        return self.world.all_reduce(torch.tensor(parts, dtype=torch.float64), what=what).tolist()

    def measure(self, acc: Grads, loss: float, error: str) -> tuple[float, float]:
        if not self.linear:  # a rank whose probe failed still joins (its gradient so far, zeros elsewhere)
            acc[:] = self.jb.data.combine(acc, self.comm, self.params)
        vals, _ = self.reduce(self._model(acc))
        inner, loss_sum, failed = self._sums(self._dot(vals, self.grads) * self.inv_scale, loss * self.loss_weight,
                                             float(bool(error)), what="gradloc probe combine")
        if failed > 0:
            self._raise_failed(error)
        total_sq = self.norm ** 2
        return (inner / total_sq if total_sq > 0 else math.nan), loss_sum / self.jb.layout.dp

    def _model(self, acc: Grads) -> Grads:
        """The model backends' own reduction of a probe's gradient (Megatron SP's ``sequence_parallel`` ones),
        on a copy of the list: ``acc`` keeps this rank's part, so a probe added to it later is not summed twice."""
        for b in self.jb.parts:
            acc = b.combine_probe(acc, self.params, self.jb.layout)
        return acc

    def norms(self, acc: Grads) -> tuple[float, float]:
        vals, _ = self.reduce(self._model(acc))
        c_sq, d_sq = self._sums(self._sq(vals), self._distance_sq(vals), what="gradloc probe norms")
        return math.sqrt(max(c_sq, 0.0)), math.sqrt(max(d_sq, 0.0))

    def _dot(self, a: Grads, b: Grads) -> float:
        parts = [torch.dot(x.reshape(-1).double(), y.reshape(-1).double()) * w  # (*shape) -> (numel,)
                 for x, y, w in zip(a, b, self.weights) if x is not None and y is not None]
        return float(torch.stack(parts).sum()) if parts else 0.0

    def _sq(self, a: Grads) -> float:
        return sum(grad_norm([x]) ** 2 * w for x, w in zip(a, self.weights) if x is not None)

    def _distance_sq(self, acc: Grads) -> float:
        """Σ_i w_i ‖∇_i · inv_scale − ∇_C,i‖² directly (no cancellation when the culprits dominate)."""
        total = 0.0
        for g, c, w in zip(self.grads, acc, self.weights):
            if g is None and c is None:
                continue
            if g is None:
                total += grad_norm([c]) ** 2 * w
            elif c is None:
                total += grad_norm([g]) ** 2 * self.inv_scale ** 2 * w
            else:
                total += float((g.double() * self.inv_scale - c.double()).pow(2).sum()) * w
        return total


class ZeroScope(JobScope):
    """DeepSpeed ZeRO 0–3: probes by ``torch.autograd.grad``; ∇_C all-reduced full-size and divided by W,
    ⟨∇_C, ∇⟩ from each rank's gradient slices (``parallel/zero/stats.zero_combine``)."""

    def __init__(self, *, deepspeed: Any, **kwargs: Any) -> None:
        from gradloc.parallel.zero.stats import AutogradProbeSession

        gas = int(deepspeed.engine.gradient_accumulation_steps())
        super().__init__(session=lambda *a: AutogradProbeSession(*a, loss_factor=1.0 / gas), **kwargs)
        self.deepspeed = deepspeed
        self.lockstep, self.linear, self.decomposes = bool(deepspeed.lockstep_probes), False, False
        self.contribution = 1.0 / self.comm.world_size

    def measure(self, acc: Grads, loss: float, error: str) -> tuple[float, float]:
        from gradloc.parallel.zero.stats import zero_combine

        explained, _, _, loss_c, failed = zero_combine(self.deepspeed.access, self.comm, acc, loss, bool(error),
                                                       self.norm ** 2)
        if failed:
            self._raise_failed(error)
        return explained, loss_c

    def norms(self, acc: Grads) -> tuple[float, float]:
        """‖∇_C‖ of the job's (full, combined) ∇_C; ‖∇ − ∇_C‖² = ‖∇‖² − 2⟨∇_C, ∇⟩ + ‖∇_C‖² with the inner
        product from each rank's gradient slices (one all-reduce)."""
        access = self.deepspeed.access
        full = [g if g is not None else torch.zeros(access.full_shape(i), device=access.device)
                for i, g in enumerate(acc)]
        inner = float(self.comm.all_reduce(torch.tensor([access.local_dot(full)], dtype=torch.float64),
                                           what="gradloc probe norms")[0])
        if not access.collectives_per_boundary:
            inner /= self.comm.world_size  # the full modes: every rank held the whole dot product
        c_sq = float(sum(float(f.double().pow(2).sum()) for f in full))
        return math.sqrt(c_sq), math.sqrt(max(self.norm ** 2 - 2.0 * inner + c_sq, 0.0))


def opener(job: Any, params: list[nn.Parameter], metas: Any, probe: ProbeFn, pause_hooks: Callable[[bool], None],
           session: Callable[..., ProbeSession] = ProbeSession) -> Opener:
    """How every probe session of a rank opens (its scope's ``session``, alone or in a job): inside the job's
    probe context (DDP: ``no_sync``), the token hooks paused unless ``hooks`` (the on_spike re-run)."""
    def open_session(hooks: bool = False) -> ContextManager[ProbeSession]:
        suspend = _keep_hooks if hooks else pause_hooks
        return _Session(session(job.model, params, metas, probe, suspend), job.probe_context())
    return open_session


def _keep_hooks(on: bool) -> None:
    """A session's suspend callback that leaves the token hooks as they are."""


class _Session:
    """A probe session inside the job's probe context (DDP: no_sync)."""

    def __init__(self, session: ProbeSession, context: ContextManager[Any]) -> None:
        self.session, self.context = session, context

    def __enter__(self) -> ProbeSession:
        self.context.__enter__()
        return self.session.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.session.__exit__(*exc)
        finally:
            self.context.__exit__(*exc)


__all__ = ["JobScope", "ZeroScope", "opener"]
