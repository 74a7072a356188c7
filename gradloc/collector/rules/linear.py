"""nn.Linear: y_p = W a_p + b, so position p routes g_p a_pᵀ into ∇W and g_p into ∇b.

‖g_p a_pᵀ‖_F² = ‖g_p‖²·‖a_p‖² — no outer product is ever formed. ‖a_p‖² (shape ``lead``) is taken in
the forward hook, so the activation itself is not kept alive by gradloc.
"""
from __future__ import annotations

import torch
from torch import nn

from gradloc.collector.rules.registry import feature_lead, register_rule, sq_norm_last
from gradloc.collector.shards import row_bias_factor


def affine_score(weight: torch.Tensor, bias: torch.Tensor | None, a_sq: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """‖g_p‖²·‖a_p‖² (if ``weight`` trains) + ‖g_p‖² (if ``bias`` trains), float32 of shape ``lead``.

    Shared by every layer computing y_p = a_p·W (+ b) in some orientation of W (nn.Linear, HF Conv1D).
    """
    g_sq = sq_norm_last(g)  # (*lead, d_out) -> (*lead)
    score = g_sq * a_sq if weight.requires_grad else torch.zeros_like(g_sq)
    if bias is not None and bias.requires_grad:
        score = score + g_sq * row_bias_factor(weight, bias)  # a row-parallel bias: once over the tp ranks
    return score


@register_rule(nn.Linear)
class LinearRule:
    input_only = True  # capture is ‖x_p‖²: shared by modules called on the same input

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        return feature_lead(y)

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return sq_norm_last(x)  # (*lead, d_in) -> (*lead)

    def score(self, module: nn.Module, saved: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return affine_score(module.weight, module.bias, saved, g)
