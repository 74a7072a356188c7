"""nn.Embedding: position p routes g_p into row ``ids[p]`` of ∇E, so its contribution norm² is ‖g_p‖².

Positions holding ``padding_idx`` contribute nothing (that row never receives gradient).
"""
from __future__ import annotations

import torch
from torch import nn

from gradloc.collector.rules.registry import register_rule, sq_norm_last


@register_rule(nn.Embedding)
class EmbeddingRule:
    broadcasts = True  # called with ids (1, T) broadcast over the batch: collector/fit.py expands the output

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape)  # ids (*lead) -> y (*lead, d)

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        if module.padding_idx is None:
            return None
        return x != module.padding_idx  # (*lead) bool

    def score(self, module: nn.Module, saved: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
        g_sq = sq_norm_last(g)  # (*lead, d) -> (*lead)
        return g_sq if saved is None else g_sq * saved
