"""Megatron-core's tensor parallelism: ``ColumnParallelLinear`` / ``RowParallelLinear`` (plain ``nn.Module``s
holding plain tensors, activations ``[s, b, h]``), on their tensor-parallel group.

Recognised by the modules (``megatron.core.tensor_parallel`` classes, by name: megatron is never imported).
What it owns:

- **where gradients live**: a partitioned weight (``tensor_model_parallel`` set, ``partition_dim``) holds
  rows or columns ``[r·n, (r+1)·n)`` of the whole on tp rank r (its slice key says so); every other
  parameter is replicated over the tp group;
- **per-token scores**: the rules in ``collector/rules/megatron.py`` score the ``[s, b, h]`` layout; the
  column-parallel one's output features and the row-parallel one's input features split a position's
  contribution over the tp ranks; the row-parallel bias, added after the all-reduce, is counted once;
- **probes**: the user's closure, every tp rank together.

The tp coordinate is read from the layers themselves (their partition sizes and ``tp_group``, as the rule
does), not from ``parallel_state``: layers built with an explicit ``tp_group`` need no global state, and layers
that disagree (different tp groups) are refused at attach rather than counted on the wrong coordinate.

Sequence parallelism (``sequence_parallel=True``): the column-parallel input is a sequence shard all-gathered
inside the layer's autograd function and the row-parallel output is reduce-scattered, so no hook sees both
factors of a position's weight term; ``parallel/megatron_sp.py`` has each rank give its factors per linear and the
token group's one all-reduce per step (``parallel/tokens.py``) forms the products — no collective in a hook. The
SP region's norms (parameters marked ``sequence_parallel``) are scored on their rank's positions. Per-layer norms
read the gradients at ``end_step``: the ``sequence_parallel`` parameters' gradients must be all-reduced over tp by
then (Megatron's ``finalize_model_grads`` does it before the optimizer step), and are counted once, as any
parameter replicated over tp. What cannot be scored exactly is refused at attach (``megatron_sp.check_model``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradloc.collector.rules.megatron import is_megatron_linear, tp_rank_size
from gradloc.errors import UnsupportedModelError
from gradloc.parallel.backend import ModelBackend, register_backend
from gradloc.parallel.megatron_sp import check_model, configure
from gradloc.parallel.placement import SliceKey

is_megatron_parallel = is_megatron_linear


@register_backend
class MegatronTP(ModelBackend):
    name, dim, order = "megatron", "tp", 45

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.sequence_parallel = False

    @classmethod
    def detect(cls, model: nn.Module, world: Any) -> "MegatronTP | None":
        found = [m for m in model.modules() if is_megatron_parallel(m)]
        if world is None or not found:
            return None
        coords = {tp_rank_size(m) for m in found}
        if len(coords) > 1:
            raise UnsupportedModelError(f"gradloc: Megatron parallel linears on different tensor-parallel groups "
                                        f"(rank, size: {sorted(coords)}): one tp group per model is supported")
        backend = cls(*coords.pop())
        backend.sequence_parallel = any(getattr(m, "sequence_parallel", False) for m in found)
        if backend.sequence_parallel:
            check_model(model)
        return backend

    def coords(self) -> dict[str, tuple[int, int]]:
        return {"tp": (self.rank, self.size)}

    def configure_hooks(self, hooks: Any, layout: Any) -> None:
        from gradloc.collector.shards import TPContext

        hooks.tp = TPContext(size=self.size)  # a module left whole (replicated over tp) counts 1/tp
        if self.sequence_parallel:
            if layout is not None and layout.size("pp") > 1:
                check_model(nn.Module(), layout.size("pp"))  # refused: the stages' factors would not line up
            configure(hooks, self.rank, self.size)

    def combine_probe(self, acc: Any, params: list[nn.Parameter], layout: Any) -> Any:
        """Under SP: the probe's ``sequence_parallel`` gradients (each rank's positions' part) summed over the tp
        group (the token group: SP refuses PP), one all-reduce under the job's deadline, as Megatron's
        ``finalize_model_grads`` sums the step's before they are read. A new list (``acc`` untouched); a gradient
        this rank does not have yet counts as zeros (every rank sends the same sizes)."""
        idx = [i for i, p in enumerate(params) if getattr(p, "sequence_parallel", False)]
        if not self.sequence_parallel or not idx or layout is None or layout.token is None:
            return acc
        parts = [acc[i] if acc[i] is not None else torch.zeros_like(params[i]) for i in idx]
        flat = torch.cat([t.reshape(-1) for t in parts])  # each (*shape) -> (numel,), concatenated
        flat = layout.token.all_reduce(flat, what="gradloc probe sequence-parallel grads")
        out = list(acc)
        for i, t, part in zip(idx, parts, torch.split(flat, [t.numel() for t in parts])):
            out[i] = part.view_as(t)  # (numel,) -> (*shape)
        return out

    def slice_key(self, name: str, param: nn.Parameter) -> SliceKey | None:
        if not getattr(param, "tensor_model_parallel", False):
            return None
        d = int(getattr(param, "partition_dim", 0))
        shape = list(param.shape)
        offset = [0] * param.dim()
        offset[d] = self.rank * shape[d]
        shape[d] *= self.size
        return (name, tuple(shape), tuple(offset), tuple(param.shape))


__all__ = ["MegatronTP", "is_megatron_parallel"]
