"""nn.Embedding: position p routes g_p into row ``ids[p]`` of ∇E, so its contribution norm² is ‖g_p‖².

Positions holding ``padding_idx`` contribute nothing (that row never receives gradient).
"""
from __future__ import annotations

import torch
from torch import nn

from gradloc.collector.rules.registry import register_duck_rule, register_rule, sq_norm_last
from gradloc.collector.shards import is_dtensor, local


@register_rule(nn.Embedding)
class EmbeddingRule:
    broadcasts = True  # called with ids (1, T) broadcast over the batch: collector/fit.py expands the output

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape)  # ids (*lead) -> y (*lead, d)

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        keep = None if module.padding_idx is None else x != module.padding_idx  # (*lead) bool
        rows = _row_shard(module.weight)
        if rows is not None:  # a vocabulary shard (TP): only ids in this rank's rows reach its gradient
            mine = (x >= rows[0]) & (x < rows[0] + rows[1])  # (*lead) bool
            keep = mine if keep is None else keep & mine
        return keep

    def score(self, module: nn.Module, saved: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
        g_sq = sq_norm_last(g)  # (*lead, d) -> (*lead)
        return g_sq if saved is None else g_sq * saved


def _row_shard(weight: torch.Tensor, dim_name: str = "tp") -> tuple[int, int] | None:
    """(first row, rows) of this rank's vocabulary shard when a DTensor table is split by rows along the tensor-
    parallel mesh dim (the lookup itself split: each rank sees only its ids); None otherwise. A split along any
    other dim is FSDP's storage, gathered whole for the lookup."""
    if not is_dtensor(weight):
        return None
    placements, names = weight.placements, weight.device_mesh.mesh_dim_names or ()
    if dim_name not in names:
        return None
    i = names.index(dim_name)
    p = placements[i]
    if not (p.is_shard() and p.dim == 0):
        return None
    n, rank = weight.device_mesh.size(i), weight.device_mesh.get_local_rank(i)
    chunk = -(-weight.shape[0] // n)  # torch.chunk's split: ceil(V / n) rows per rank
    start = min(rank * chunk, weight.shape[0])
    return start, max(0, min(chunk, weight.shape[0] - start))


def is_vocab_parallel_embedding(module: nn.Module) -> bool:
    """torchtitan's ``Embedding``: an nn.Embedding whose own forward splits the vocabulary over a TP group
    (``tp_group``; None: a plain lookup)."""
    return isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward \
        and hasattr(module, "tp_group")


@register_duck_rule(is_vocab_parallel_embedding)
class VocabParallelEmbeddingRule(EmbeddingRule):
    """Rank r holds rows [offset, offset + rows) of a vocabulary split in chunks of ⌈V/tp⌉: position p
    routes g_p into this rank's ∇E only when its id falls there (the forward masks the others' output), so
    the score is ‖g_p‖² there and 0 elsewhere; the TP group's scores add up to the whole table's."""

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        keep = EmbeddingRule.capture(self, module, x, y)
        group = module.tp_group
        if group is None or _row_shard(module.weight) is not None:  # no TP, or the DTensor said where
            return keep
        import torch.distributed as dist

        rows = local(module.weight).shape[0]
        offset = dist.get_rank(group) * ((module.num_embeddings + dist.get_world_size(group) - 1)
                                         // dist.get_world_size(group))
        mine = (x >= offset) & (x < offset + rows)  # (*lead) bool
        return mine if keep is None else mine & keep
