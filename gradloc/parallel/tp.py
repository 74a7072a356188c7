"""Tensor and sequence parallelism with DTensor (``parallelize_module`` with ``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``; torchtitan's plans), alone or under FSDP2 (2D).

Recognised by the parameters: DTensors on a mesh with a dim named ``tp``. What it owns:

- **where gradients live**: each parameter's DTensor placements; shards add up, replicas count once
  (``placement.replica_weights`` from the slices), Partial gradients (a replicated norm weight used on
  sequence-sharded activations) are summed over the tp group before any norm;
- **per-token scores**: the hooks go *before* the styles' own output hooks (``TokenHooks.prepend``) and
  see the module's DTensor input and output: they score the local shards (``collector/shards.py``). A
  column-parallel linear's output features, a row-parallel linear's input features and a vocabulary
  shard's rows split each position's contribution over the tp ranks (their scores add up); a module
  computing the same thing on every tp rank (replicated weights, replicated activations) has its score
  divided by tp; a sequence-sharded module (SequenceParallel) scores its own positions. The token
  group sums the scores once per step;
- **probes**: the user's closure, run by every tp rank together (the tp ranks of a data index hold the
  same view and take the same decisions).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from gradloc.parallel.backend import ModelBackend, register_backend


def mesh_dim(t: Any, name: str) -> int | None:
    """Index of the dim called ``name`` in a DTensor's mesh, or None."""
    names = getattr(getattr(t, "device_mesh", None), "mesh_dim_names", None) or ()
    return names.index(name) if name in names else None


@register_backend
class TensorParallel(ModelBackend):
    name, dim, order = "tp", "tp", 40

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.index = mesh.mesh_dim_names.index("tp")

    @classmethod
    def detect(cls, model: nn.Module, world: Any) -> "TensorParallel | None":
        if world is None:
            return None
        for p in model.parameters():
            if mesh_dim(p, "tp") is not None:
                return cls(p.device_mesh)
        return None

    def coords(self) -> dict[str, tuple[int, int]]:
        return {"tp": (self.mesh.get_local_rank(self.index), self.mesh.size(self.index))}

    def configure_hooks(self, hooks: Any, layout: Any) -> None:
        from gradloc.collector.shards import TPContext

        hooks.tp = TPContext(size=layout.size("tp"))


__all__ = ["TensorParallel", "mesh_dim"]
