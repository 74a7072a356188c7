"""A DeepSpeed engine's per-layer statistics behind the collector's interface, and its probes.

:class:`DeepSpeedLayerStats` is what ``Monitor`` uses in place of ``LayerStatsCollector`` when
``gradloc.watch`` is handed a ``DeepSpeedEngine``: the same layer names (``engine.module``'s
parameters grouped as on a plain model), but the (4L + 1,) pack comes from
:class:`~gradloc.parallel.zero.grads.DeepSpeedGradAccess`, which reads the gradient where each
ZeRO stage keeps it and combines the ranks' partitions (one all_gather, partitioned stages only).
The pack is already the job's, identical on every rank, so the step gather does not sum it again.

:class:`AutogradProbeSession` runs the probes DeepSpeed allows (docs/deepspeed-notes.md §c): the
user's closure on the raw module, the gradient taken with ``torch.autograd.grad`` (never
``.backward()``, which fires ZeRO's reduction hooks), scaled by 1/gradient_accumulation_steps as
``engine.backward`` scales the training loss.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from gradloc.collector.layer_stats import LayerStatsCollector
from gradloc.collector.packs import layer_pack
from gradloc.config import LayerGrouping
from gradloc.errors import ProbeError
from gradloc.localizer.probes import Grads, ProbeSession
from gradloc.parallel.zero.grads import PARTITIONS, DeepSpeedGradAccess, zero_pack

log = logging.getLogger("gradloc")


class DeepSpeedLayerStats(LayerStatsCollector):
    def __init__(self, engine: Any, grouping: LayerGrouping, comm: Any = None) -> None:
        super().__init__(engine.module, grouping)
        self.engine = engine
        self.access = DeepSpeedGradAccess(engine, grouping)
        if comm is not None and comm.world_size == self.access.world:  # the partitions' group is the job
            self.access.comm = comm
        if self.access.layers != self.layers:  # both group engine.module's parameters: never expected
            raise AssertionError("DeepSpeed layer names differ from the module's")
        self.device = self.access.device
        self.sharded = False  # the access combined the partitions: the pack is the job's already
        self._uncovered = [False] * len(self.params)
        self.off_boundary = 0  # end_step calls off the gradient-accumulation boundary (no statistics)

    def alone(self) -> None:
        """Left the job: the access sees its communicator broken and reports no statistics (grad_pack)."""

    @property
    def lockstep_probes(self) -> bool:
        """ZeRO-3's forward gathers parameters (collectives): every rank must take part in every probe."""
        return self.access.mode == PARTITIONS

    def at_boundary(self) -> bool:
        return bool(self.engine.is_gradient_accumulation_boundary())

    def set_uncovered(self, uncovered: Sequence[bool]) -> None:
        super().set_uncovered(uncovered)
        self._uncovered = [bool(u) for u in uncovered]
        self.access.set_uncovered(self._uncovered)

    def param_bytes(self) -> int:
        return sum(int(getattr(p, "ds_numel", p.numel())) * p.element_size() for p in self.params)

    def grad_pack(self, inv_scale: float | torch.Tensor = 1.0, unattributed: Sequence[int] = ()) -> torch.Tensor:
        """The job's (4L + 1,) pack; all zeros (no layer present) off the boundary or when a rank could
        not read its gradient. DeepSpeed divides by its own loss scale: ``inv_scale`` (a torch
        GradScaler's) does not apply."""
        L = self.n_layers
        if self.access.comm is not None and self.access.comm.broken:  # left the job: no collective, no stats
            return torch.zeros(len(layer_pack(L)), device=self.device)
        if unattributed:  # modules that went unscored this step: their ‖g‖² is unattributed too
            flags = list(self._uncovered)
            for i in unattributed:
                flags[i] = True
            self.access.set_uncovered(flags)
        try:
            pack = self.access.grad_pack()  # zero_pack(L)
        finally:
            if unattributed:
                self.access.set_uncovered(self._uncovered)
        if pack is None:
            self.off_boundary += 1
            return torch.zeros(len(layer_pack(L)), device=self.device)
        layout = zero_pack(L)
        ok = (layout.get(pack, "ranks_ok") == self.access.contributors).to(pack.dtype)  # (1,), device-side: no sync
        return layout.segment(pack, "grad_sq", "uncovered_sq") * ok  # the layer pack

    def nonfinite_counts(self) -> list[int]:
        if self.access.comm is not None and self.access.comm.broken:
            return [0] * self.n_layers
        return self.access.nonfinite_counts()  # a collective when partitioned: every rank comes here together

    def grads(self) -> list[torch.Tensor | None]:
        return [None] * len(self.params)  # partitioned: use access.local_dot, never whole .grad tensors


class AutogradProbeSession(ProbeSession):
    """Probes by ``torch.autograd.grad``: nothing accumulates into ``.grad``, no ZeRO hook fires."""

    def __init__(self, *args: Any, loss_factor: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_factor = loss_factor

    def __enter__(self) -> "AutogradProbeSession":
        super().__enter__()
        for p, g in zip(self.params, self._saved):  # nothing accumulates into .grad: leave it readable
            p.grad = g
        return self

    def add_to(self, acc: Grads, micro_batch: int, token_mask: torch.Tensor) -> Grads:
        meta = self.metas[micro_batch]
        meta.rng.restore()
        self.count += 1
        loss = self.closure(micro_batch, token_mask)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ProbeError("the probe closure must return a scalar loss tensor that requires grad")
        loss = loss * self.loss_factor  # engine.backward divides the training loss by the accumulation steps
        self.losses.append(float(loss.detach()))
        got = torch.autograd.grad(loss, self.params, allow_unused=True)
        out: Grads = []
        for a, g in zip(acc, got):
            out.append(g if a is None else (a if g is None else a.add_(g)))
        return out


def zero_combine(access: DeepSpeedGradAccess, comm: Any, g_c: Grads, loss_c: float, error: bool,
                 total_sq: float) -> tuple[float, float, float, float, bool]:
    """(explained, ‖∇_C‖, ‖∇ − ∇_C‖, ℓ_C, some rank failed) of the job's culprit gradient.

    ∇_C: every rank's probe gradient (zeros where it probed nothing), summed over ranks and ÷ W, as
    DeepSpeed averages the training gradient: one all-reduce of full-size fp32 tensors. ⟨∇_C, ∇⟩:
    each rank's gradient slices against the same elements of ∇_C, summed by one all-reduce of three
    scalars (with ℓ_C and the failure flag). ‖∇ − ∇_C‖² = ‖∇‖² − 2⟨∇_C, ∇⟩ + ‖∇_C‖².
    """
    W = comm.world_size
    full = [(g.float() if g is not None else torch.zeros(access.full_shape(i), device=access.device))
            for i, g in enumerate(g_c)]
    if W > 1:
        comm.all_reduce_(full, "gradloc probe combine")
    torch._foreach_div_(full, float(W))
    g_c[:] = full
    mine = access.local_dot(full)
    parts = torch.tensor([mine, loss_c, float(error)], dtype=torch.float64)
    inner, loss, failed = comm.all_reduce(parts, what="gradloc probe combine scalars").tolist()
    if not access.collectives_per_boundary:
        inner /= W  # the full modes: every rank held the whole dot product
    c_sq = float(sum(float(f.double().pow(2).sum()) for f in full))
    d_sq = max(total_sq - 2.0 * inner + c_sq, 0.0)
    explained = inner / total_sq if total_sq > 0 else float("nan")
    return explained, c_sq ** 0.5, d_sq ** 0.5, loss / W, failed > 0
