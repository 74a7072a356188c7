"""Per-layer statistics of a DeepSpeed engine's global gradient at the gradient-accumulation boundary.

Call :meth:`DeepSpeedGradAccess.grad_pack` on every rank after ``engine.backward(loss)`` of the last
micro-step and before ``engine.step()``. DeepSpeed has reduced the gradient by then (inside that
``backward``) and has not clipped it yet (``step`` does); docs/deepspeed-notes.md has the evidence.

Where the gradient is at that point (DeepSpeed 0.19.8, read from its source and checked by
tests/distributed/test_deepspeed_grads.py):

============================  ==============================  =========================================
optimizer DeepSpeed built     gradient of parameter p         on each rank
============================  ==============================  =========================================
stage 0, fp32: the client's   ``p.grad``                      full, all-reduced mean
stage 0, bf16/fp16:           ``p.grad`` (× loss scale)       full, all-reduced mean
FP16_(Unfused)Optimizer
stage 1, bf16 params, fp32    ``p._hp_grad`` (fp32)           full, all-reduced mean
accumulation: BF16_Optimizer
stages 1, 2:                  ``p._hp_mapping`` fragment of   the slice of p this rank's optimizer
DeepSpeedZeroOptimizer        ``averaged_gradients``          partition owns (``p.grad`` is None)
stage 3                       ``safe_get_local_grad(p)``      this rank's partition of the ``ds_numel``
                                                              elements (``p`` itself has shape (0,))
============================  ==============================  =========================================

Each rank reduces what it holds into a local pack; where the gradient is partitioned and there are
W > 1 ranks, **one** ``all_gather`` of the (4L + 2,) packs combines them (sums, and max for max |g|).
That is the only collective: nothing runs off the boundary, and the full modes need none.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from gradloc.collector.layer_stats import ParamGroups, combine_packs, pack_slices, unpack_layers
from gradloc.collector.packs import Pack, layer_pack
from gradloc.config import LayerGrouping
from gradloc.errors import UnsupportedModelError
from gradloc.records import LayerStats

log = logging.getLogger("gradloc")

FULL, FULL_HP, FRAGMENTS, PARTITIONS = "full", "full_hp", "fragments", "partitions"


class DeepSpeedGradAccess:
    """The packed per-layer statistics of the gradient the optimizer will see, on every rank.

    Pack layout (float32, 4L + 2 for L layer groups): ``packs.layer_pack`` (what
    :meth:`LayerStatsCollector.grad_pack` gives) followed by ``ranks_ok``; ``ranks_ok`` counts the ranks whose local read
    succeeded and equals :attr:`contributors` when the pack is valid. Gradients are divided by the
    optimizer's loss scale; parameters are the model's (low-precision under bf16) values.
    Layer names are ``engine.module``'s parameter names grouped like the plain model's.
    """

    def __init__(self, engine: Any, grouping: LayerGrouping = "module") -> None:
        _check_engine(engine)
        self.engine = engine
        g = ParamGroups.of(engine.module, grouping)
        if not g.params:
            raise UnsupportedModelError("the DeepSpeed engine's module has no trainable parameters")
        self.names, self.params, self.layers, self.group_of, self.numel = g.names, g.params, g.layers, g.group_of, g.numel
        self.mode = _mode(engine, self.names, self.params)
        self.process_group, self.world = _process_group(self.mode, self.params)
        first = self.params[0]
        self.device = first.ds_tensor.device if hasattr(first, "ds_tensor") else first.device
        self.rank = torch.distributed.get_rank(self.process_group) if self.world > 1 else 0  # in that group
        self._uncovered = [0.0] * len(self.params)
        self.comm: Any = None  # a gradloc JobComm over the same ranks: its collectives wait with a deadline
        self.off_boundary_calls = 0  # grad_pack calls that returned None: nothing done, nothing sent
        self.failed_reads = 0  # boundaries where this rank could not read its gradient (logged)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def collectives_per_boundary(self) -> int:
        """Collectives one :meth:`grad_pack` issues at a boundary (0 off the boundary)."""
        return 1 if self.mode in (FRAGMENTS, PARTITIONS) and self.world > 1 else 0

    @property
    def contributors(self) -> int:
        """The value of a valid pack's ``ranks_ok``."""
        return self.world if self.collectives_per_boundary else 1

    def set_uncovered(self, uncovered: Sequence[bool]) -> None:
        """Mark the parameters (in :attr:`names` order) no per-token rule attributes."""
        if len(uncovered) != len(self.params):
            raise ValueError(f"uncovered has {len(uncovered)} entries for {len(self.params)} parameters")
        self._uncovered = [float(u) for u in uncovered]

    def grad_pack(self) -> torch.Tensor | None:
        """The (4L + 2,) pack at a boundary, on :attr:`device`; None off the boundary (no work, no collective).

        A collective in the partitioned modes with W > 1 ranks: call it on every rank, at the same
        point. A rank that fails to read its gradient still joins the collective (``ranks_ok`` is
        then short), so ranks never desynchronise.
        """
        if not self.engine.is_gradient_accumulation_boundary():
            self.off_boundary_calls += 1
            return None
        try:
            local = self._local_pack(1.0 / _loss_scale(self.engine))
        except Exception:  # noqa: BLE001 - must still join the collective below
            self.failed_reads += 1
            log.exception("gradloc: could not read the DeepSpeed gradient on this rank; the step's stats are dropped")
            local = torch.zeros(4 * self.n_layers + 2, device=self.device)
        if not self.collectives_per_boundary:
            return local
        return self._combine(local)

    def _local_pack(self, inv_scale: float) -> torch.Tensor:
        L = self.n_layers
        grads, params, idx, present, unc = [], [], [], [], []
        for i, p in enumerate(self.params):
            got = self._local_slice(p)
            if got is None:
                continue
            g, theta, first, _ = got
            grads.append(g)
            params.append(theta)
            idx.append(self.group_of[i])
            present.append(1.0 if first else 0.0)
            unc.append(self._uncovered[i])
        ok = torch.ones(1, device=self.device)  # ranks_ok: this rank read its gradient
        if not grads:  # this rank owns no slice of any gradient
            return zero_pack(L).build(**layer_pack(L).split(torch.zeros(len(layer_pack(L)), device=self.device)),
                                      ranks_ok=ok)
        dev = self.device
        pack = pack_slices(L, torch.tensor(idx, device=dev), grads, params, inv_scale, torch.tensor(present, device=dev),
                           torch.tensor(unc, device=dev))
        return zero_pack(L).build(**layer_pack(L).split(pack), ranks_ok=ok)  # (4L + 1,) + (1,)

    def _local_slice(self, p: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor, bool, int] | None:
        """(gradient slice, parameter slice, whether this rank counts p as present, where the slice starts
        in p's flattened elements), or None if it holds none."""
        if self.mode == FULL:
            return None if p.grad is None else (p.grad, p.detach(), True, 0)
        if self.mode == FULL_HP:
            g = getattr(p, "_hp_grad", None)
            return None if g is None else (g, p.detach(), True, 0)
        if self.mode == FRAGMENTS:
            mapping = p._hp_mapping
            if mapping is None:
                return None
            start, n = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
            g = mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)  # (n,) or (p.numel(),)
            if g.numel() != n:  # BF16-style full accumulation buffer: keep the owned fragment only
                g = g.narrow(0, start, n)
            return g, p.detach().reshape(-1).narrow(0, start, n), start == 0, start  # (numel,) -> (n,)
        from deepspeed.utils import safe_get_local_grad  # stage 3; deepspeed is present if the engine is

        g = safe_get_local_grad(p)
        if g is None:
            return None
        real = max(0, min(p.partition_numel(), p.ds_numel - self.rank * p.partition_numel()))  # the rest is padding
        if real == 0:
            return None
        start = self.rank * p.partition_numel()
        return g.reshape(-1).narrow(0, 0, real), p.ds_tensor.detach().reshape(-1).narrow(0, 0, real), self.rank == 0, start

    def local_dot(self, full: Sequence[torch.Tensor | None]) -> float:
        """Σ over this rank's gradient slices of ⟨slice, the same elements of ``full``⟩ (one full-size
        tensor per parameter, in :attr:`names` order; e.g. a probe gradient), divided by the loss scale.
        In the partitioned modes the ranks' values sum to the whole dot product (an all-reduce the
        caller runs); in the full modes every rank holds all of it. No collective here."""
        terms = []
        for p, c in zip(self.params, full):
            got = self._local_slice(p) if c is not None else None
            if got is None:
                continue
            g, _, _, start = got
            g = g.reshape(-1)  # (n,): the slice's elements, in p's flattened order from ``start``
            c = c.reshape(-1).narrow(0, start, g.numel()).to(g.device, torch.float32)  # (numel,) -> (n,)
            terms.append(torch.dot(g.float(), c))
        if not terms:
            return 0.0
        return float(torch.stack(terms).double().sum()) / _loss_scale(self.engine)

    def full_shape(self, i: int) -> torch.Size:
        """The shape of parameter ``i``'s whole gradient (ZeRO-3 parameters are (0,) outside forward)."""
        p = self.params[i]
        return torch.Size(getattr(p, "ds_shape", p.shape))

    def _combine(self, local: torch.Tensor) -> torch.Tensor:
        """One all_gather of the W local packs, reduced locally: identical on every rank."""
        L = self.n_layers
        if self.comm is not None:  # raises CollectiveTimeout instead of hanging on a dead peer
            packs = self.comm.all_gather(local, "gradloc DeepSpeed layer pack")  # (W, 4L + 2)
        else:
            gathered = torch.empty(self.world * local.numel(), dtype=local.dtype, device=local.device)
            gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
            gather(gathered, local, group=self.process_group)
            packs = gathered.view(self.world, local.numel())  # (W·(4L + 2),) -> (W, 4L + 2)
        return combine_packs(packs, L)

    def nonfinite_counts(self) -> list[int]:
        """Exact inf/NaN gradient entries per layer. Rare path for a non-finite pack; a collective (one
        all_reduce) in the partitioned modes with W > 1, so call it on every rank — the combined pack
        is identical on all ranks, so they all take this path together."""
        counts = torch.zeros(self.n_layers, dtype=torch.float64, device=self.device)
        for i, p in enumerate(self.params):
            got = self._local_slice(p)
            if got is not None:
                counts[self.group_of[i]] += (~torch.isfinite(got[0])).sum()
        if self.collectives_per_boundary and self.comm is not None:
            counts = self.comm.all_reduce(counts, what="gradloc DeepSpeed non-finite counts")
        elif self.collectives_per_boundary:
            torch.distributed.all_reduce(counts, group=self.process_group)
        return [int(c) for c in counts.tolist()]

    def valid(self, host: Sequence[float]) -> bool:
        """Whether every contributing rank read its gradient (host copy of a pack)."""
        return int(round(zero_pack(self.n_layers).scalar(host, "ranks_ok"))) == self.contributors

    def unpack(self, host: Sequence[float], nonfinite: Sequence[int] | None = None) -> tuple[LayerStats, ...]:
        """LayerStats of the layers that had a gradient (host copy of a valid pack)."""
        return unpack_layers(host, self.layers, self.numel, nonfinite)

    def global_norm(self, host: Sequence[float]) -> float:
        """‖g‖ of the whole gradient (host copy of a pack)."""
        return float(sum(float(x) for x in zero_pack(self.n_layers).get(host, "grad_sq"))) ** 0.5


def zero_pack(L: int) -> Pack:
    """A ZeRO gradient pack: the layer pack, then how many ranks read their gradient slices."""
    return layer_pack(L) + Pack.of(ranks_ok=1)


def _check_engine(engine: Any) -> None:
    for attr in ("module", "optimizer", "is_gradient_accumulation_boundary", "zero_optimization_stage"):
        if not hasattr(engine, attr):
            raise UnsupportedModelError(f"expected a deepspeed.DeepSpeedEngine (it has no {attr!r}); "
                                        f"got {type(engine).__name__}")
    unverified = {
        "pipeline parallelism": getattr(engine, "pipeline_parallelism", False),
        "MoE layers": getattr(engine, "has_moe_layers", False),
        "model/tensor parallelism (engine.mpu)": getattr(engine, "mpu", None) is not None,
        "sequence parallelism": getattr(engine, "sequence_parallel_size", 1) > 1,
        "optimizer offload": _offload(engine),
        "ZenFlow": bool(getattr(engine, "zenflow", False)),
        "fp16 torch_autocast with a GradScaler": getattr(engine, "torch_autocast_z0_gradscaler", None) is not None,
        # unmanaged: ZeRO 0/1 reduce (and ZeRO 2 assembles averaged_gradients) inside step(), after no boundary
        "managed_gradient_accumulation=false": not _call(engine, "managed_gradient_accumulation", True),
    }
    used = [name for name, on in unverified.items() if on]
    if used:
        raise UnsupportedModelError(f"DeepSpeed gradient access is verified for data parallelism with ZeRO 0-3 "
                                    f"only; this engine uses {', '.join(used)}")


def _offload(engine: Any) -> bool:
    """Optimizer offload is on: a configured device other than "none" (OpenRLHF writes ``offload_optimizer:
    {"device": "none"}`` when nothing is offloaded; DeepSpeed's own ``zero_cpu_offload()`` reads the device too)."""
    cfg = _call(engine, "zero_offload_optimizer", None)
    if cfg is None:
        return False
    device = getattr(cfg, "device", None) if not isinstance(cfg, dict) else cfg.get("device")
    return str(getattr(device, "value", device)).lower() != "none"


def _call(engine: Any, method: str, default: Any) -> Any:
    """``engine.method()``, or ``default`` where this DeepSpeed version has no such method."""
    fn = getattr(engine, method, None)
    return default if fn is None else fn()


def _mode(engine: Any, names: list[str], params: list[torch.nn.Parameter]) -> str:
    stage = int(engine.zero_optimization_stage())
    if stage == 3:
        _require(names, params, "ds_id", "ZeRO-3 did not partition it")
        return PARTITIONS
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    if isinstance(engine.optimizer, BF16_Optimizer):
        return FULL_HP
    if stage in (1, 2):
        _require(names, params, "_hp_mapping", f"ZeRO-{stage} did not map it (not in the optimizer's groups?)")
        return FRAGMENTS
    return FULL


def _require(names: list[str], params: list[torch.nn.Parameter], attr: str, why: str) -> None:
    missing = [n for n, p in zip(names, params) if not hasattr(p, attr)]
    if missing:
        raise UnsupportedModelError(f"trainable parameter {missing[0]!r} (and {len(missing) - 1} more) has no "
                                    f"{attr}: {why}")


def _process_group(mode: str, params: list[torch.nn.Parameter]) -> tuple[Any, int]:
    if mode in (FULL, FULL_HP):
        return None, 1
    attr = "_dp_group" if mode == FRAGMENTS else "ds_process_group"
    groups = {id(getattr(p, attr)): getattr(p, attr) for p in params}
    if len(groups) != 1:
        raise UnsupportedModelError(f"parameters are partitioned over {len(groups)} process groups; one is supported")
    group = next(iter(groups.values()))
    dist = torch.distributed
    return group, (dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1)


def _loss_scale(engine: Any) -> float:
    """The factor the stored gradients carry: the ZeRO/FP16 optimizers' loss scale, 1 otherwise."""
    if not (engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled()):
        return 1.0  # the client optimizer itself: no scaling
    scale = getattr(engine.optimizer, "loss_scale", None)
    return 1.0 if scale is None else float(scale)
