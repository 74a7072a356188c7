"""Expert parallelism: MoE experts sharded over an expert group (torchtitan: DTensors on a mesh dim ``ep``).

Each rank holds E/ep experts; the expert group's ranks hold different tokens (ep is carved out of the
data dimension), so it is no model dimension: the replica weights come from the experts' slices.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from gradloc.parallel.backend import ModelBackend, register_backend
from gradloc.parallel.tp import mesh_dim


@register_backend
class ExpertParallel(ModelBackend):
    name, dim, order = "ep", "ep", 50

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.index = mesh.mesh_dim_names.index("ep")

    @classmethod
    def detect(cls, model: nn.Module, world: Any) -> "ExpertParallel | None":
        if world is None:
            return None
        for p in model.parameters():
            if mesh_dim(p, "ep") is not None:
                return cls(p.device_mesh)
        return None


__all__ = ["ExpertParallel"]
