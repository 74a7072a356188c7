"""Megatron-core's tensor parallelism: ``ColumnParallelLinear`` / ``RowParallelLinear`` (plain ``nn.Module``s
holding plain tensors, activations ``[s, b, h]``), with the TP group of ``megatron.core.parallel_state``.

Recognised by the modules (``megatron.core.tensor_parallel`` classes; megatron is imported only when one
is there). What it owns:

- **where gradients live**: a partitioned weight (``tensor_model_parallel`` set, ``partition_dim``) holds
  rows or columns ``[r·n, (r+1)·n)`` of the whole on tp rank r (its slice key says so); every other
  parameter is replicated over the tp group;
- **per-token scores**: the rules in ``collector/rules/megatron.py`` score the ``[s, b, h]`` layout; the
  column-parallel one's output features and the row-parallel one's input features split a position's
  contribution over the tp ranks; the row-parallel bias, added after the all-reduce, is counted once;
- **probes**: the user's closure, every tp rank together.

Sequence parallelism (``sequence_parallel=True``: the column-parallel input gathered inside the layer)
is not supported: the layer's input norms live only inside its all-gather; refused at attach.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from gradloc.errors import UnsupportedModelError
from gradloc.parallel.backend import ModelBackend, register_backend
from gradloc.parallel.placement import SliceKey

_CLASSES = ("ColumnParallelLinear", "RowParallelLinear")


def is_megatron_parallel(module: nn.Module) -> bool:
    return type(module).__name__ in _CLASSES and type(module).__module__.startswith("megatron.")


@register_backend
class MegatronTP(ModelBackend):
    name, dim, order = "megatron", "tp", 45

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    @classmethod
    def detect(cls, model: nn.Module, world: Any) -> "MegatronTP | None":
        found = [m for m in model.modules() if is_megatron_parallel(m)]
        if world is None or not found:
            return None
        if any(getattr(m, "sequence_parallel", False) for m in found):
            raise UnsupportedModelError("gradloc: Megatron parallel linears with sequence_parallel=True are not "
                                        "supported (their input is gathered inside the layer); use "
                                        "sequence_parallel=False")
        from megatron.core import parallel_state as ps

        return cls(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())

    def coords(self) -> dict[str, tuple[int, int]]:
        return {"tp": (self.rank, self.size)}

    def configure_hooks(self, hooks: Any, layout: Any) -> None:
        from gradloc.collector.shards import TPContext

        hooks.tp = TPContext(size=self.size)  # a module left whole (replicated over tp) counts 1/tp

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
