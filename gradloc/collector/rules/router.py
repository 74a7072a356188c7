"""MoE routers (transformers 5.x ``*TopKRouter``: Mixtral, Qwen3-MoE, gpt-oss): logits_p = W x_p (+ b),
returned first of (logits, top-k scores, top-k indices). Position p routes δ_p x_pᵀ into ∇W (δ_p =
∂L/∂logits_p, which gathers the gradient that reaches the logits through the top-k weights, and
through an auxiliary loss when there is one) and δ_p into ∇b: ‖δ_p‖²‖x_p‖² (+ ‖δ_p‖²), the Linear
rule on the router's logits. The input may come as (B, T, H) or flattened (B·T, H).
"""
from __future__ import annotations

import torch
from torch import nn

from gradloc.collector.rules.linear import affine_score
from gradloc.collector.rules.registry import feature_lead, register_duck_rule, sq_norm_last


def is_router(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("Router") and isinstance(weight, nn.Parameter) and weight.dim() == 2
            and hasattr(module, "top_k"))


@register_duck_rule(is_router)
class RouterRule:
    def output(self, out: object) -> object:
        """The tensor the rule scores: the logits, first of the router's outputs."""
        return out[0] if isinstance(out, tuple) and out else out

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        return feature_lead(y)  # logits (N, E) -> (N,)

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return sq_norm_last(x.reshape(-1, x.shape[-1]))  # (*lead, H) -> (N, H) -> (N,)

    def score(self, module: nn.Module, saved: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        bias = getattr(module, "bias", None)
        return affine_score(module.weight, bias if isinstance(bias, nn.Parameter) else None, saved, g)
