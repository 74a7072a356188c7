"""FSDP2 built the way PyTorch's own example builds it (``examples/distributed/FSDP2/example.py``:
``fully_shard`` on each decoder layer, then on the root; default ``reshard_after_forward``, no mixed precision,
no other option), around the Hugging Face Llama of tests/defaults/ddp_job.py, and HSDP: the same calls with
``mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))`` (FSDP2's hybrid sharding:
replicated over one mesh dim, sharded over the other).

The loop is ddp_job.py's (two micro-batches, the default detector, the token planted ×3000 on the last rank after
``HEALTHY`` healthy steps, ``clip_grad_norm_`` after ``end_step``), each micro-batch's backward synchronised:
FSDP2 reduce-scatters every backward unless told otherwise (``set_requires_gradient_sync``), and its example does
not tell it. Each variant with gradloc and without it (the bitwise check)."""
from __future__ import annotations

from typing import Any

import torch

from tests.defaults.ddp_job import llama, train


def variants() -> dict[str, dict[str, Any]]:
    """Name -> how the model is sharded (``mesh``: the DeviceMesh's shape and dim names; none: FSDP2's default
    1-D mesh over every rank)."""
    return {
        "fsdp2": {"accumulate": "sync"},
        "hsdp": {"accumulate": "sync", "mesh": ((2, 2), ("replicate", "shard"))},
    }


def build(kwargs: dict[str, Any]) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = llama()
    mesh = kwargs.get("mesh")
    extra = {} if mesh is None else {"mesh": init_device_mesh("cpu", mesh[0], mesh_dim_names=mesh[1])}
    for layer in model.model.layers:
        fully_shard(layer, **extra)
    fully_shard(model, **extra)
    return model


def run_all(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    """Every variant in ``names``, with gradloc and without it; the plant on the last rank."""
    table = variants()
    return {name: {"with": train(rank, world, table[name], True, world - 1, builder=build),
                   "without": train(rank, world, table[name], False, world - 1, builder=build)}
            for name in names}
