"""Per-layer gradient statistics with foreach kernels: one packed tensor, one host transfer.

Layout of :meth:`LayerStatsCollector.grad_pack` (all float32, length 4·L for L layer groups):
``[grad_sq(L) | grad_max_abs(L) | param_sq(L) | present(L)]``. Exact non-finite counts are only
computed on the rare path where a norm came out non-finite.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from gradloc.config import LayerGrouping
from gradloc.records import LayerStats


def group_name(param_name: str, grouping: LayerGrouping) -> str:
    if callable(grouping):
        return str(grouping(param_name))
    if grouping == "parameter":
        return param_name
    parts = param_name.split(".")
    if grouping == "module":
        return ".".join(parts[:-1]) or param_name
    return ".".join(parts[: min(int(grouping), max(len(parts) - 1, 1))])


def foreach_norms(tensors: list[torch.Tensor], ord: float = 2.0) -> torch.Tensor:
    """Per-tensor norms as one float32 tensor (P,); low-precision tensors are reduced in float32.

    ``_foreach_norm(dtype=float32)`` refuses float64 inputs, so those are reduced in their own
    dtype and cast.
    """
    wide = [i for i, t in enumerate(tensors) if t.dtype == torch.float64]
    if not wide:
        return torch.stack(torch._foreach_norm(tensors, ord, dtype=torch.float32))
    narrow = [i for i in range(len(tensors)) if tensors[i].dtype != torch.float64]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for i, n in zip(wide, torch._foreach_norm([tensors[i] for i in wide], ord)):
        out[i] = n.float()
    if narrow:
        for i, n in zip(narrow, torch._foreach_norm([tensors[i] for i in narrow], ord, dtype=torch.float32)):
            out[i] = n
    return torch.stack(out)  # type: ignore[arg-type]


def max_abs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor max |x| as float32 (P,). ``aminmax`` reads each tensor once without an |x| copy; the
    ∞-norm kernel was ~18× slower on CPU (bench/overhead.py --profile)."""
    out = []
    for t in tensors:
        if t.numel() == 0:
            out.append(torch.zeros((), device=t.device))
            continue
        lo, hi = torch.aminmax(t)
        out.append(torch.maximum(hi.float(), -lo.float()))
    return torch.stack(out)


class LayerStatsCollector:
    def __init__(self, model: nn.Module, grouping: LayerGrouping) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        groups = [group_name(n, grouping) for n in self.names]
        self.layers: list[str] = list(dict.fromkeys(groups))
        index = {g: i for i, g in enumerate(self.layers)}
        self._group_of = [index[g] for g in groups]
        self.numel = [0] * len(self.layers)
        for p, g in zip(self.params, self._group_of):
            self.numel[g] += p.numel()
        self._device = self.params[0].device if self.params else torch.device("cpu")
        self._group_index = torch.tensor(self._group_of, dtype=torch.long, device=self._device)
        self._snapshot: list[torch.Tensor] | None = None
        self._partial_index: dict[tuple[int, ...], torch.Tensor] = {}

    def _index_for(self, present: tuple[int, ...]) -> torch.Tensor:
        """Group index of the parameters that have a gradient; cached per pattern, so a step where
        some parameters got none does not copy a fresh index to the device every time."""
        idx = self._partial_index.get(present)
        if idx is None:
            if len(self._partial_index) >= 16:  # patterns that keep changing (MoE): stay bounded
                self._partial_index.clear()
            idx = self._partial_index[present] = self._group_index[list(present)]
        return idx

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def grads(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.params]

    def grad_pack(self, inv_scale: float | torch.Tensor = 1.0, uncovered: torch.Tensor | None = None) -> torch.Tensor:
        """Packed per-layer stats on the device; gradients multiplied by ``inv_scale`` (GradScaler).

        With ``uncovered`` (P,) 0/1 per parameter, one more entry is appended: Σ ‖g‖² of the
        uncovered parameters (those no per-token rule attributes).
        """
        L = self.n_layers
        if isinstance(inv_scale, torch.Tensor):  # a float64 GradScaler scale would promote the packs
            inv_scale = inv_scale.to(self._device, torch.float32)
        present = [i for i, p in enumerate(self.params) if p.grad is not None]
        idx = self._group_index if len(present) == len(self.params) else self._index_for(tuple(present))
        grads = [self.params[i].grad for i in present]
        params = [self.params[i].detach() for i in present]
        zeros = torch.zeros(L, device=self._device)
        if grads:
            g_norm = foreach_norms(grads)  # (P,)
            g_max = max_abs(grads)
            p_norm = foreach_norms(params)
            grad_sq = zeros.index_add(0, idx, g_norm.pow(2) * inv_scale**2)
            grad_max = zeros.scatter_reduce(0, idx, g_max * inv_scale, "amax", include_self=True)
            param_sq = zeros.index_add(0, idx, p_norm.pow(2))
            has = zeros.index_add(0, idx, torch.ones_like(g_norm))
            extra = [(g_norm.pow(2) * inv_scale**2 * uncovered[present]).sum()[None]] if uncovered is not None else []
        else:
            grad_sq, grad_max, param_sq, has = zeros, zeros, zeros, zeros
            extra = [zeros[:1]] if uncovered is not None else []
        return torch.cat([grad_sq, grad_max, param_sq, has, *extra])  # 4 × (L,) [+ 1] -> (4L [+ 1],)

    def nonfinite_counts(self) -> list[int]:
        """Exact count of inf/NaN gradient entries per layer (rare path: one sync per layer hit)."""
        counts = [0] * self.n_layers
        for p, g in zip(self.params, self._group_of):
            if p.grad is not None:
                counts[g] += int((~torch.isfinite(p.grad)).sum())
        return counts

    # -- update-to-weight ratio: snapshot before optimizer.step(), difference after ------------
    def take_snapshot(self) -> None:
        if self._snapshot is None:
            self._snapshot = [torch.empty_like(p, memory_format=torch.preserve_format) for p in self.params]
        torch._foreach_copy_(self._snapshot, [p.detach() for p in self.params])

    def update_sq(self) -> torch.Tensor | None:
        """Per-layer ‖θ_after − θ_before‖² on the device (consumes the snapshot)."""
        if self._snapshot is None:
            return None
        torch._foreach_sub_(self._snapshot, [p.detach() for p in self.params])  # before − after
        norms = foreach_norms(self._snapshot)  # (P,)
        return torch.zeros(self.n_layers, device=self._device).index_add(0, self._group_index, norms.pow(2))

    def release_snapshot(self) -> None:
        self._snapshot = None

    def unpack(self, host: Sequence[float], nonfinite: Sequence[int] | None,
               update_sq: Sequence[float] | None) -> tuple[LayerStats, ...]:
        L = self.n_layers
        out = []
        for i, name in enumerate(self.layers):
            grad_sq, gmax, psq, has = host[i], host[L + i], host[2 * L + i], host[3 * L + i]
            if has == 0:
                continue  # no gradient reached this layer this step
            ratio = None
            if update_sq is not None and psq > 0:
                ratio = (update_sq[i] ** 0.5) / (psq**0.5)
            out.append(LayerStats(name, float(grad_sq) ** 0.5, float(gmax), nonfinite[i] if nonfinite else 0,
                                  float(psq) ** 0.5, self.numel[i], None if ratio is None else float(ratio)))
        return tuple(out)


def module_layer_map(model: nn.Module, grouping: LayerGrouping) -> dict[str, str]:
    """Module name -> layer group of its direct parameters (so token layers match layer stats)."""
    out: dict[str, str] = {}
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            out.setdefault(mname, group_name(full, grouping))
    return out

