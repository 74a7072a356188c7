"""Parallel layouts gradloc refuses at attach, with the reason, rather than answer wrong (issue 32).

- **Context parallelism** (torchtitan's ``cp`` mesh dim, Megatron's ``context_parallel_size``): each rank holds a
  shard of every sequence, and attention exchanges keys and values between the shards. The parameters are not
  split along ``cp`` — torchtitan's FSDP2 shards them over the flattened ``dp_shard_cp`` dim — so the job looks
  like plain data parallelism, and a token's scores, a sample's surprise and the probes' token masks would all
  be read against a sequence shard as if it were the whole row. Found from the parameters' root mesh (a dim
  named ``cp`` larger than 1) or Megatron's parallel state (only when megatron-core is already imported).
- **Several pipeline stages on one rank** (interleaved 1F1B, looped BFS, zero-bubble ZBV: ``num_stages``
  larger than the pipeline group): gradloc watches one stage per rank, and its probes run one stage's
  send/recv.

Every check reads values that are the same on every rank, so every rank refuses together.
"""
from __future__ import annotations

import sys
from typing import Any

from torch import nn


def context_parallel(params: list[tuple[str, nn.Parameter]]) -> str:
    """Why this job is context parallel ('' when it is not)."""
    for name, p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            continue
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        names = getattr(root, "mesh_dim_names", None) or ()
        if "cp" in names and root.size(names.index("cp")) > 1:
            return f"parameter {name!r} lives on a mesh with a context-parallel dim (cp = {root.size(names.index('cp'))})"
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        try:
            size = int(ps.get_context_parallel_world_size()) if ps.model_parallel_is_initialized() else 1
        except Exception:  # noqa: BLE001 - a partly initialised Megatron: nothing to say
            size = 1
        if size > 1:
            return f"Megatron's context_parallel_size is {size}"
    return ""


def several_stages(stage: Any) -> str:
    """Why this pipeline stage shares its rank with other stages ('' when it does not)."""
    stages, group = int(getattr(stage, "num_stages", 1)), int(getattr(stage, "group_size", 0) or 0)
    if group and stages > group:
        return (f"the pipeline has {stages} stages on {group} ranks (an interleaved or zero-bubble schedule: "
                "several stages per rank); gradloc watches one stage per rank (ScheduleGPipe, Schedule1F1B)")
    return ""


__all__ = ["context_parallel", "several_stages"]
