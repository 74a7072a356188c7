"""nn.LayerNorm: y_p = x̂_p ⊙ w + b, so position p routes g_p ⊙ x̂_p into ∇w and g_p into ∇b.

x̂ is recomputed in the tensor hook from the input, which autograd saves for LayerNorm's own
backward anyway: gradloc holds a reference, not a copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradloc.collector.rules.registry import register_rule, sq_norm_last


def layer_norm_hat(x: torch.Tensor, n_dims: int, eps: float) -> torch.Tensor:
    """x̂ = (x − mean) / sqrt(var + eps) over the last ``n_dims`` dims, in float32 (the fused
    layer_norm kernel without affine parameters; ~9× faster than mean/var/rsqrt on CPU)."""
    return F.layer_norm(x.float(), tuple(x.shape[x.dim() - n_dims:]), eps=eps)


@register_rule(nn.LayerNorm)
class LayerNormRule:
    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        return tuple(y.shape[: y.dim() - len(module.normalized_shape)])

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.detach()  # shares storage with the tensor autograd already saved

    def score(self, module: nn.Module, saved: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return self.score_grouped(module, saved, g, 0)

    def score_grouped(self, module: nn.Module, saved: torch.Tensor, g: torch.Tensor, extra: int) -> torch.Tensor:
        """With ``extra`` position-sharing dims after (B, T) (a norm per head), the weight and bias
        receive Σ_h of the heads' contributions: summed before squaring."""
        n = len(module.normalized_shape)
        lead = g.dim() - n - extra
        share = tuple(range(lead, lead + extra))  # the position-sharing dims
        gb = g.float().sum(dim=share) if extra else g  # (*lead, *h, *feat) -> (*lead, *feat)
        g_sq = sq_norm_last(gb, n)  # (*lead, *normalized_shape) -> (*lead)
        score = torch.zeros_like(g_sq)
        if module.weight is not None and module.weight.requires_grad:
            v = g.float() * layer_norm_hat(saved, n, module.eps)
            score = score + sq_norm_last(v.sum(dim=share) if extra else v, n)  # (*lead, *h, *feat) -> (*lead)
        if module.bias is not None and module.bias.requires_grad:
            score = score + g_sq
        return score
