"""The localizer's scopes for a multi-rank job: one per data parallelism, registered by kind.

Each says how a probe runs and how its gradient combines over the ranks (``localizer/scope.py`` has
the contract; the algorithm is the one ``Localizer``):

- **DDP**: a probe runs in ``no_sync()`` (its backward must not start the gradient all-reduce on one
  rank only) and ranks without candidates idle; ∇_C is summed over ranks by one all-reduce per
  tensor and divided by W, as DDP averages the training gradient, so every rank holds the job's ∇_C
  and the stored gradient (the job's, on every rank) gives the shares locally. The decomposition
  probe runs on the rank that holds the micro-batch.
- **FSDP2**: a probe's forward and backward are collectives (parameter all-gather, gradient
  reduce-scatter), so every rank takes part in every probe (lockstep). The reduce-scatter already
  combined ∇_C, sharded: one all-reduce of shard-local scalars gives ⟨∇_C, ∇⟩ and ℓ_C, another the norms.
- **DeepSpeed ZeRO 0–3**: probes by ``torch.autograd.grad`` (no ZeRO hook fires), lockstep under
  ZeRO-3; ∇_C all-reduced full-size and divided by W, ⟨∇_C, ∇⟩ from each rank's gradient slices
  (``deepspeed/stats.zero_combine``).

Every collective has the job's deadline (``JobComm``).
"""
from __future__ import annotations

import math
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from gradloc.adapters.dist import JobComm
from gradloc.collector.layer_stats import local
from gradloc.localizer.probes import Grads, ProbeFn, ProbeSession, distance, dot, grad_norm
from gradloc.localizer.scope import ProbeFailed

_SCOPES: dict[str, type] = {}


def register_scope(kind: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        if kind in _SCOPES:
            raise ValueError(f"a localizer scope for {kind!r} is already registered")
        _SCOPES[kind] = cls
        return cls

    return deco


def scope_for(kind: str, **kwargs: Any) -> "_JobScope":
    """The registered scope of a job kind ("ddp", "fsdp", "deepspeed")."""
    if kind not in _SCOPES:
        raise ValueError(f"no localizer scope for job kind {kind!r} (known: {sorted(_SCOPES)})")
    return _SCOPES[kind](**kwargs)


class _JobScope:
    lockstep, linear, decomposes, job = False, False, False, True

    def __init__(self, *, comm: JobComm, model: nn.Module, params: list[nn.Parameter], metas: Any, probe: ProbeFn,
                 pause_hooks: Callable[[bool], None], probe_context: Callable[[], ContextManager[Any]],
                 grads: Grads, inv_scale: float, norm: float, deepspeed: Any = None) -> None:
        self.comm, self.model, self.params, self.metas, self.probe = comm, model, params, metas, probe
        self.pause_hooks, self.probe_context, self.deepspeed = pause_hooks, probe_context, deepspeed
        self.grads, self.inv_scale, self.norm = grads, inv_scale, norm
        self.contribution = 1.0 / comm.world_size

    def _new_session(self) -> ProbeSession:
        return ProbeSession(self.model, self.params, self.metas, self.probe, self.pause_hooks)

    def session(self) -> ContextManager[ProbeSession]:
        return _Session(self._new_session(), self.probe_context())

    def _raise_failed(self, error: str) -> None:
        errors = self.comm.all_gather_object(error, "gradloc probe errors")
        raise ProbeFailed("; ".join(e for e in errors if e))


@register_scope("ddp")
class DDPScope(_JobScope):
    decomposes = True

    def measure(self, acc: Grads, loss: float, error: str) -> tuple[float, float]:
        W = self.comm.world_size
        full = [g if g is not None else torch.zeros_like(p) for g, p in zip(acc, self.params)]
        self.comm.all_reduce_(full, "gradloc probe combine")  # Σ over ranks …
        torch._foreach_div_(full, float(W))  # … averaged, as DDP averages the training gradient
        acc[:] = full
        flags = self.comm.all_reduce(torch.tensor([loss, float(bool(error))], dtype=torch.float64),
                                     what="gradloc probe loss")
        if flags[1] > 0:  # every rank learns what failed where (one more collective, on this path only)
            self._raise_failed(error)
        total_sq = self.norm ** 2
        return (dot(full, self.grads, self.inv_scale) / total_sq if total_sq > 0 else math.nan), float(flags[0]) / W

    def norms(self, acc: Grads) -> tuple[float, float]:
        return grad_norm(acc), distance(self.grads, acc, self.inv_scale)


@register_scope("fsdp")
class FSDPScope(_JobScope):
    lockstep, linear = True, True  # ∇_C and ∇ are this rank's shards of the job's

    def measure(self, acc: Grads, loss: float, error: str) -> tuple[float, float]:
        gl, sl = _locals(acc), _locals(self.grads)
        parts = torch.tensor([dot(gl, sl, self.inv_scale), loss, float(bool(error))], dtype=torch.float64)
        inner, loss_sum, failed = self.comm.all_reduce(parts, what="gradloc probe combine").tolist()
        if failed > 0:
            self._raise_failed(error)
        total_sq = self.norm ** 2
        return (inner / total_sq if total_sq > 0 else math.nan), loss_sum / self.comm.world_size

    def norms(self, acc: Grads) -> tuple[float, float]:
        gl, sl = _locals(acc), _locals(self.grads)
        parts = torch.tensor([grad_norm(gl) ** 2, distance(sl, gl, self.inv_scale) ** 2], dtype=torch.float64)
        c_sq, d_sq = self.comm.all_reduce(parts, what="gradloc probe norms").tolist()
        return math.sqrt(c_sq), math.sqrt(d_sq)


@register_scope("deepspeed")
class ZeroScope(_JobScope):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lockstep = bool(self.deepspeed.lockstep_probes)  # ZeRO-3's forward gathers parameters

    def _new_session(self) -> ProbeSession:
        from gradloc.adapters.deepspeed.stats import AutogradProbeSession

        gas = int(self.deepspeed.engine.gradient_accumulation_steps())
        return AutogradProbeSession(self.model, self.params, self.metas, self.probe, self.pause_hooks,
                                    loss_factor=1.0 / gas)

    def measure(self, acc: Grads, loss: float, error: str) -> tuple[float, float]:
        from gradloc.adapters.deepspeed.stats import zero_combine

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


def _locals(grads: Grads) -> Grads:
    return [None if g is None else local(g) for g in grads]


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
