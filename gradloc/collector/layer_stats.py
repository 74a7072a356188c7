"""Per-layer gradient statistics with foreach kernels: one packed tensor, one host transfer.

Layout of :meth:`LayerStatsCollector.grad_pack`: ``collector/packs.layer_pack`` (float32, 4·L + 1 for L layer
groups: ‖g‖², max |g|, ‖θ‖², present, and the unattributed parameters' squares). Exact non-finite
counts are only computed on the rare path where a norm came out non-finite.

In a job (``parallel/job.py``, :meth:`LayerStatsCollector.relayout`) L is the job's layer list (every
pipeline stage's layers) and each parameter's squares are multiplied by its replica weight (1 / the
ranks holding the same slice), so that the world-wide sum of the ranks' packs is the job's exact pack.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from gradloc.collector.packs import layer_pack
from gradloc.config import LayerGrouping
from gradloc.records import LayerStats

GradViewFn = Callable[[list, list], tuple[list, list[float]]]  # (grads, params) -> (local values, weight factors)


def group_name(param_name: str, grouping: LayerGrouping) -> str:
    if callable(grouping):
        return str(grouping(param_name))
    if grouping == "parameter":
        return param_name
    parts = param_name.split(".")
    if grouping == "module":
        return ".".join(parts[:-1]) or param_name
    return ".".join(parts[: min(int(grouping), max(len(parts) - 1, 1))])


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters and gradients); any other tensor as it is.

    For reading statistics only: a DTensor's ``_local_tensor`` is the shard itself, outside autograd (no
    ``.detach()`` needed) and ~100× cheaper than ``to_local()``, an autograd function that costs 8–20 µs a
    call unloaded (several of them per parameter per step). ``to_local()`` where a tensor subclass lacks it.
    """
    shard = getattr(t, "_local_tensor", None)
    if isinstance(shard, torch.Tensor):
        return shard
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


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
    ∞-norm kernel was ~18× slower on CPU (python -m bench overhead --profile)."""
    out = []
    for t in tensors:
        if t.numel() == 0:
            out.append(torch.zeros((), device=t.device))
            continue
        lo, hi = torch.aminmax(t)
        out.append(torch.maximum(hi.float(), -lo.float()))
    return torch.stack(out)


@dataclass
class _DeviceGroup:
    """The parameters that live on one device, with their group index (and uncovered mask) there."""

    device: torch.device
    members: list[int]  # indices into LayerStatsCollector.params
    group_index: torch.Tensor  # (len(members),) long: layer group of each member
    uncovered: torch.Tensor | None = None  # (len(members),) 0/1: no per-token rule attributes it
    partial: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    weight: torch.Tensor | None = None  # (len(members),) each parameter's replica weight (1 outside a job)

    def __post_init__(self) -> None:
        if self.weight is None:
            self.weight = torch.ones(len(self.members), device=self.device)
        self._factors: dict[tuple[float, ...], torch.Tensor] = {}

    def factor(self, factors: tuple[float, ...]) -> torch.Tensor:
        """The gradients' placement factors as a device tensor (cached: they repeat every step)."""
        t = self._factors.get(factors)
        if t is None:
            if len(self._factors) >= 16:
                self._factors.clear()
            t = self._factors[factors] = torch.tensor(factors, device=self.device)
        return t


class LayerStatsCollector:
    """Per-layer statistics of the gradients at the optimizer boundary.

    Parameters may be spread over several devices (``device_map="auto"``): each device reduces its
    own parameters into one packed (4L + 1,) tensor, the packs are combined on the primary device
    (the first parameter's), and the step still makes one host transfer.
    """

    def __init__(self, model: nn.Module, grouping: LayerGrouping) -> None:
        g = ParamGroups.of(model, grouping)
        self.names, self.params, self.layers, self.group_of, self.numel = g.names, g.params, g.layers, g.group_of, g.numel
        self.local_layers, self.local_numel = list(g.layers), list(g.numel)  # this rank's own, before relayout
        self.device = self.params[0].device if self.params else torch.device("cpu")
        # in a job whose ranks hold slices (FSDP2, TP, PP): this rank's weighted share, summed over the
        # world by the step's one gather (collector/job.py); False: every rank's pack is the job's
        self.sharded = False
        self.weights: list[float] = [1.0] * len(self.params)
        self.grad_view: GradViewFn | None = None  # set in a job whose gradients are DTensors (parallel/placement.py)
        self._build_groups()

    def _build_groups(self) -> None:
        by_device: dict[torch.device, list[int]] = {}
        for i, p in enumerate(self.params):
            by_device.setdefault(p.device, []).append(i)
        self._groups = [_DeviceGroup(dev, members, torch.tensor([self.group_of[i] for i in members],
                                                                dtype=torch.long, device=dev),
                                     weight=torch.tensor([self.weights[i] for i in members], device=dev))
                        for dev, members in by_device.items()]

    def relayout(self, layers: Sequence[str], numel: Sequence[int], index: Sequence[int],
                 weights: Sequence[float] | None, grad_view: GradViewFn | None = None) -> None:
        """The job's layers (this rank's layer i is the job's ``index[i]``) and each parameter's replica
        weight (None: every rank's pack is the job's already). ``grad_view(grads, params)``: the gradients'
        local values, with DTensor Partial placements summed over their group (a collective), and the factor
        of each parameter's weight for its gradient's placement (parallel/placement.GradView)."""
        self.layers, self.numel = list(layers), list(numel)
        self.group_of = [int(index[g]) for g in self.group_of]
        self.sharded = weights is not None
        self.weights = list(weights) if weights is not None else [1.0] * len(self.params)
        self.grad_view = grad_view
        self._build_groups()

    def alone(self) -> None:
        """This rank left its job (a failed collective): its own slices' statistics from now on, each at full
        weight, never summed (its records say their layers are not the job's: ``layers_global=False``)."""
        self.sharded, self.weights = False, [1.0] * len(self.params)
        self._build_groups()

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return tuple(g.device for g in self._groups)

    def param_bytes(self) -> int:
        """Bytes of the trainable parameters this rank holds (its shards when sharded)."""
        return sum(local(p).numel() * p.element_size() for p in self.params)

    def persistent_bytes(self) -> int:
        """Device memory this collector keeps between steps (index and mask tensors)."""
        tensors = [t for g in self._groups for t in (g.group_index, g.uncovered, *g.partial.values())
                   if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def set_uncovered(self, uncovered: Sequence[bool]) -> None:
        """Mark the parameters no per-token rule attributes (their ‖g‖² is the unattributed share)."""
        for g in self._groups:
            g.uncovered = torch.tensor([1.0 if uncovered[i] else 0.0 for i in g.members], device=g.device)

    def grads(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.params]

    def grad_pack(self, inv_scale: float | torch.Tensor = 1.0, unattributed: Sequence[int] = ()) -> torch.Tensor:
        """Packed per-layer stats on the primary device; gradients multiplied by ``inv_scale``.

        Layout ``[grad_sq(L) | grad_max_abs(L) | param_sq(L) | present(L) | uncovered_sq(1)]``;
        ``uncovered_sq`` also counts the parameters listed in ``unattributed`` (indices of covered
        parameters whose module was not scored this step).
        """
        extra = set(unattributed)
        packs = [self._device_pack(g, inv_scale, extra) for g in self._groups]
        if len(packs) == 1:
            return packs[0]
        return combine_packs(torch.stack([p.to(self.device, non_blocking=True) for p in packs]), self.n_layers)

    def _device_pack(self, g: _DeviceGroup, inv_scale: float | torch.Tensor, extra: set[int]) -> torch.Tensor:
        L = self.n_layers
        if isinstance(inv_scale, torch.Tensor):  # a float64 GradScaler scale would promote the packs
            inv_scale = inv_scale.to(g.device, torch.float32)
        present = [j for j, i in enumerate(g.members) if self.params[i].grad is not None]
        whole = len(present) == len(g.members)
        idx = g.group_index if whole else self._index_for(g, tuple(present))
        raw = [self.params[g.members[j]].grad for j in present]
        if not raw:
            return torch.zeros(len(layer_pack(L)), device=g.device)
        w = g.weight if whole else g.weight[present]  # (P_present,) the parameters' replica weights
        wg = w
        if self.grad_view is not None:  # DTensor gradients: local values, and their own placements' weights
            grads, factors = self.grad_view(raw, [self.params[g.members[j]] for j in present])
            if any(f != 1.0 for f in factors):
                wg = w * g.factor(tuple(factors))
        else:
            grads = [local(t) for t in raw]
        params = [local(self.params[g.members[j]]).detach() for j in present]
        unc = g.uncovered if g.uncovered is not None else torch.zeros(len(g.members), device=g.device)
        unc = unc if whole else unc[present]
        if extra:  # rare: a module's calls could not be scored this step
            unc = torch.maximum(unc, torch.tensor([float(g.members[j] in extra) for j in present], device=g.device))
        return pack_slices(L, idx, grads, params, inv_scale, torch.ones(len(grads), device=g.device), unc, wg, w)

    @staticmethod
    def _index_for(g: _DeviceGroup, present: tuple[int, ...]) -> torch.Tensor:
        """Group index of the members that have a gradient; cached per pattern, so a step where
        some parameters got none does not copy a fresh index to the device every time."""
        idx = g.partial.get(present)
        if idx is None:
            if len(g.partial) >= 16:  # patterns that keep changing (MoE): stay bounded
                g.partial.clear()
            idx = g.partial[present] = g.group_index[list(present)]
        return idx

    def nonfinite_counts(self) -> list[int]:
        """Exact count of inf/NaN gradient entries per layer (rare path: one sync per layer hit)."""
        counts = [0] * self.n_layers
        for p, g in zip(self.params, self.group_of):
            if p.grad is not None:
                counts[g] += int((~torch.isfinite(local(p.grad))).sum())
        return counts

    def unpack(self, host: Sequence[float], nonfinite: Sequence[int] | None) -> tuple[LayerStats, ...]:
        """LayerStats of the layers that received a gradient (update ratios arrive a step later)."""
        return unpack_layers(host, self.layers, self.numel, nonfinite)


def pack_slices(L: int, index: torch.Tensor, grads: list[torch.Tensor], params: list[torch.Tensor],
                inv_scale: float | torch.Tensor, present: torch.Tensor, uncovered: torch.Tensor,
                grad_weight: torch.Tensor | None = None, param_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The layer pack (``packs.layer_pack``) of the gradient slices this rank holds: ``index`` (P,) each slice's
    layer, ``present`` (P,) what it adds to its layer's present count, ``uncovered`` (P,) 0/1 no rule attributes
    it, the weights (P,) its share of a world-wide sum (replicas: 1/their count; None: 1)."""
    zeros = torch.zeros(L, device=index.device)
    g_sq = foreach_norms(grads).pow(2) * inv_scale**2  # (P,)
    p_sq = foreach_norms(params).pow(2)
    if grad_weight is not None:
        g_sq = g_sq * grad_weight
    if param_weight is not None:
        p_sq = p_sq * param_weight
    return layer_pack(L).build(grad_sq=zeros.index_add(0, index, g_sq),
                               grad_max=zeros.scatter_reduce(0, index, max_abs(grads) * inv_scale, "amax",
                                                             include_self=True),
                               param_sq=zeros.index_add(0, index, p_sq), present=zeros.index_add(0, index, present),
                               uncovered_sq=(g_sq * uncovered).sum())


def combine_packs(packs: torch.Tensor, n_layers: int) -> torch.Tensor:
    """(n, P) layer packs (devices, ranks) -> the combined (P,): sums, and max |g| by max (any fields after the
    layer pack's — a ZeRO pack's ``ranks_ok`` — sum too)."""
    total = packs.sum(0)
    span = layer_pack(n_layers).span("grad_max")
    total[span] = packs[:, span].amax(0)
    return total


def unpack_layers(host: Sequence[float], layers: Sequence[str], numel: Sequence[int],
                  nonfinite: Sequence[int] | None) -> tuple[LayerStats, ...]:
    """LayerStats from a host layer pack (``packs.layer_pack``), for the layers that received a gradient."""
    lp = layer_pack(len(layers))
    grad_sq, gmax, psq, has = (lp.get(host, f) for f in ("grad_sq", "grad_max", "param_sq", "present"))
    return tuple(LayerStats(layer=name, grad_norm=float(grad_sq[i]) ** 0.5, grad_max_abs=float(gmax[i]),
                            nonfinite=nonfinite[i] if nonfinite else 0, param_norm=float(psq[i]) ** 0.5,
                            numel=numel[i])
                 for i, name in enumerate(layers) if has[i] != 0)  # none: no gradient reached it this step


@dataclass(frozen=True)
class ParamGroups:
    """A model's trainable parameters and the layer group of each (the reporting unit of every statistic)."""

    names: list[str]
    params: list[nn.Parameter]
    layers: list[str]  # group names, first-seen order
    group_of: list[int]  # parameter i -> its layer's index
    numel: list[int]  # elements per layer (DeepSpeed ZeRO-3: ``ds_numel``, the parameters being (0,) outside forward)

    @staticmethod
    def of(model: nn.Module, grouping: LayerGrouping) -> "ParamGroups":
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        names = [n for n, _ in named]
        groups = [group_name(n, grouping) for n in names]
        layers = list(dict.fromkeys(groups))
        index = {g: i for i, g in enumerate(layers)}
        group_of = [index[g] for g in groups]
        numel = [0] * len(layers)
        for (_, p), g in zip(named, group_of):
            numel[g] += int(getattr(p, "ds_numel", p.numel()))
        return ParamGroups(names, [p for _, p in named], layers, group_of, numel)


def module_layer_map(model: nn.Module, grouping: LayerGrouping) -> dict[str, str]:
    """Module name -> layer group of its direct parameters (so token layers match layer stats)."""
    out: dict[str, str] = {}
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            out.setdefault(mname, group_name(full, grouping))
    return out

