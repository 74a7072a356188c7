"""Where each parameter's gradient lives, and the weight it enters every world-wide sum with.

A global statistic Σ_i ‖g_i‖² (and any ⟨a, b⟩ over the gradient) is computed as one world-wide sum
of per-rank, per-parameter terms. A rank holds a *slice* of each of its parameters: the whole tensor
(DDP, a module TP left alone, a pipeline stage's own layers), a shard (FSDP2, TP's Shard placements,
Megatron's partitioned weights, experts under EP), or the same slice as other ranks (replicas). So each
term is weighted by 1 / (the number of ranks that hold that very slice): replicas count once, shards
add up, whatever the mix of parallelisms. The counts come from one gather of every rank's slice keys
at attach (:func:`replica_weights`); no reasoning about meshes is needed, so a placement no backend
foresaw is still counted right — and a slice that overlaps another rank's without being equal is
refused there, never guessed.

A DTensor *gradient* can be ``Partial`` along a mesh dim (a replicated weight used on sequence-sharded
activations: SequenceParallel's norms): its local tensor is a summand, not a value. Such gradients are
summed over that dim's group first (:func:`reduce_partials`, one all-reduce per group, a copy: the
user's gradient is never touched).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from gradloc.collector.layer_stats import local
from gradloc.collector.shards import is_dtensor
from gradloc.errors import AttachError

SliceKey = tuple  # (parameter name, global shape, offset, local shape)


def dtensor_slice(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global shape, offset, local shape) of a DTensor's local shard; a plain tensor is whole."""
    if not is_dtensor(t):
        return tuple(t.shape), (0,) * t.dim(), tuple(t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(t.shape), tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def replica_weights(keys: Sequence[SliceKey], comm: Any) -> list[float]:
    """1 / (ranks holding the same slice) for each of this rank's ``keys`` (one gather over ``comm``)."""
    every = comm.all_gather_object(list(keys), "gradloc parameter slices")
    counts: dict[SliceKey, int] = {}
    spans: dict[tuple, list[tuple]] = {}
    for rank_keys in every:
        for k in rank_keys:
            counts[k] = counts.get(k, 0) + 1
            spans.setdefault((k[0], k[1]), []).append((k[2], k[3]))
    for (name, shape), pieces in spans.items():
        bad = _overlap(set(pieces))
        if bad:
            raise AttachError(f"gradloc: parameter {name!r} {shape} is held in slices that overlap without being "
                              f"equal ({bad}): no backend knows this placement, and its norm would be wrong")
    return [1.0 / counts[k] for k in keys]


def _overlap(pieces: set[tuple]) -> str:
    items = sorted(pieces)
    for i, (o1, s1) in enumerate(items):
        for o2, s2 in items[i + 1:]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(o1, s1, o2, s2)):
                return f"offsets {o1} size {s1} and {o2} size {s2}"
    return ""


def partial_dims(t: torch.Tensor | None) -> tuple[int, ...]:
    """Mesh dims along which a DTensor is Partial (its local tensor is a summand)."""
    if not is_dtensor(t):
        return ()
    return tuple(i for i, p in enumerate(t.placements) if p.is_partial())


def reduce_partials(tensors: Sequence[torch.Tensor | None], comm_for: Any) -> list[torch.Tensor | None]:
    """The local values of ``tensors`` with every Partial placement summed over its group: one all-reduce
    per (mesh, dim) over the flattened Partial tensors (copies). Other tensors: their local shard, as is.
    ``comm_for(mesh, dim)``: the deadline-guarded communicator of that mesh dim's group."""
    out = [None if t is None else local(t) for t in tensors]
    todo: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        for d in partial_dims(t):
            todo.setdefault((id(t.device_mesh), d), []).append(i)
    for (_, d), idx in todo.items():
        mesh = tensors[idx[0]].device_mesh
        flat = torch.cat([out[i].reshape(-1).float() for i in idx])  # (Σ numel,)
        summed = comm_for(mesh, d).all_reduce(flat, what="gradloc partial gradients")
        pos = 0
        for i in idx:
            n = out[i].numel()
            out[i] = summed[pos:pos + n].reshape(out[i].shape).to(out[i].dtype)  # (n,) -> local shape
            pos += n
    return out


def _replication(t: torch.Tensor) -> int:
    """Ranks of a DTensor's mesh holding the same values of it (Replicate dims; Partial, once summed)."""
    n = 1
    for i, p in enumerate(t.placements):
        if not p.is_shard():
            n *= t.device_mesh.size(i)
    return n


class GradView:
    """Gradients as the world-wide sums need them: local values (Partial placements summed) and, per
    parameter, the factor that turns its parameter's replica weight into its gradient's. A gradient can be
    placed unlike its parameter: a row-parallel embedding's is ``Replicate`` (the whole table on every tp
    rank) under a ``Shard(0)`` parameter, a SequenceParallel norm's ``Partial`` under a ``Replicate`` one.
    The factors are cached per (parameter, placements): one dict lookup per DTensor gradient per step."""

    def __init__(self, comm_for: Any) -> None:
        self.comm_for = comm_for
        self._factors: dict[tuple, float] = {}

    def __call__(self, grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor]
                 ) -> tuple[list[torch.Tensor | None], list[float]]:
        factors = []
        for p, g in zip(params, grads):
            if not (is_dtensor(g) and is_dtensor(p)):
                factors.append(1.0)
                continue
            key = (id(p), g.placements)
            f = self._factors.get(key)
            if f is None:
                same_mesh = g.device_mesh == p.device_mesh
                f = self._factors[key] = _replication(p) / _replication(g) if same_mesh else 1.0
            factors.append(f)
        return reduce_partials(grads, self.comm_for), factors


__all__ = ["GradView", "SliceKey", "dtensor_slice", "local", "partial_dims", "reduce_partials", "replica_weights"]
