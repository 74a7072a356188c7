"""Megatron-core's ``VocabParallelEmbedding`` (``megatron.core.tensor_parallel.layers``): tp rank r holds rows
``[vocab_start_index, vocab_end_index)`` of the table; its forward looks up the ids in that range (the others'
output zeroed) and all-reduces the output over the tp group, so the output ``[b, s, h]`` (batch-first: Megatron's
``LanguageModelEmbedding`` transposes it afterwards) and its gradient g_p are whole on every rank. Position p
routes g_p into row ``ids[p]`` of ∇E, which is this rank's only when the id falls in its range: the score is
‖g_p‖² there and 0 elsewhere, and the tp group's scores add up to the whole table's (its weight is
``tensor_model_parallel``: the TP view counts each rank's share once). Recognised by duck typing (class name +
module path ``megatron.*``; megatron is never imported here).

Not this rule: ``reduce_scatter_embeddings=True`` (sequence parallelism: the output is reduce-scattered into the
sequence shard ``[s/tp, b, h]``, refused at attach by parallel/megatron_sp.py).
"""
from __future__ import annotations

import torch
from torch import nn

from gradloc.collector.rules.registry import register_duck_rule, sq_norm_last


def is_megatron_embedding(module: nn.Module) -> bool:
    return type(module).__name__ == "VocabParallelEmbedding" and type(module).__module__.startswith("megatron.") \
        and not getattr(module, "reduce_scatter_embeddings", False)


@register_duck_rule(is_megatron_embedding)
class MegatronEmbeddingRule:
    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape)  # ids (b, s) -> y (b, s, h)

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(b, s) bool: the ids in this rank's rows."""
        return (x >= module.vocab_start_index) & (x < module.vocab_end_index)

    def score(self, module: nn.Module, saved: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return sq_norm_last(g) * saved  # (b, s, h) -> (b, s), 0 where another rank's row takes the gradient


__all__ = ["MegatronEmbeddingRule", "is_megatron_embedding"]
