"""The per-token score of routed MoE experts, whatever holds their weights (rules/experts.py: transformers'
fused ``*Experts``; rules/grouped_experts.py: torchtitan's ``GroupedExperts``).

The experts are called as y_p = Σ_k w_pk · f_{e_pk}(x_p) with f_e(x) = down_e(act(up_e(x))), up_e giving the
pre-activation u (gate and up halves, bias included). Token p routes, through each of its experts e = e_pk
(distinct parameter slices, so the squares add):

- into ∇down[e]: δ_pk h_pkᵀ with δ_pk = w_pk g_p (g = ∂L/∂y) and h_pk = act(u_pk): ‖δ_pk‖²‖h_pk‖² (+ ‖δ_pk‖²
  for down's bias);
- into ∇up[e]: ε_pk x_pᵀ with ε_pk = act'(u_pk)ᵀ (W_down[e]ᵀ δ_pk): ‖ε_pk‖²‖x_p‖² (+ ‖ε_pk‖² for up's bias).

:func:`routed_scores` recomputes u and h for the routed tokens, expert by expert (a host sync: which experts
were hit, as the eager implementations do), and takes ε by autograd through the layer's own activation:
about one more forward of the experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gradloc.collector.rules.registry import sq_norm_last


@dataclass(frozen=True)
class ExpertMath:
    """How one experts layer computes expert e (its weights in whatever layout the layer keeps)."""

    n_experts: int  # experts this layer holds; routed indices outside [0, n) are dropped tokens
    up: Callable[[int, torch.Tensor], torch.Tensor]  # (e, x (n, H)) -> u (n, 2I), its bias included
    act: Callable[[torch.Tensor], torch.Tensor]  # u (n, 2I) -> h (n, I)
    down_t: Callable[[int, torch.Tensor], torch.Tensor]  # (e, δ (n, H)) -> ∂L/∂h = δ W_down[e] (n, I)
    down_trains: bool
    down_bias: bool = False
    up_sq: Callable[[torch.Tensor], torch.Tensor] = sq_norm_last  # ε (n, 2I) -> Σ² over its trained parts (n,)
    up_trains: bool = True
    up_bias: bool = False


def routed_scores(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, g: torch.Tensor,
                  m: ExpertMath) -> torch.Tensor:
    """Per-token score (N,) float32 of x (N, H) routed by idx (N, K) with weights w (N, K), g = ∂L/∂y (N, H)."""
    out = torch.zeros(x.shape[0], dtype=torch.float32, device=g.device)
    x_sq = sq_norm_last(x)  # (N, H) -> (N,)
    for e in torch.unique(idx).tolist():  # the experts hit (host sync, as the eager implementations)
        if not 0 <= e < m.n_experts:
            continue  # an index outside the experts: a dropped token (HF masks with E)
        tok, slot = torch.where(idx == e)  # the (token, slot) pairs routed to e
        u = m.up(e, x[tok])  # (n, 2I)
        d_out = g[tok] * w[tok, slot].unsqueeze(-1).to(g.dtype)  # (n, H): ∂L/∂(expert e's output)
        with torch.enable_grad():
            u_ = u.detach().requires_grad_(True)
            h = m.act(u_)  # (n, I)
            d_h = m.down_t(e, d_out.to(h.dtype))  # (n, I)
            (d_u,) = torch.autograd.grad(h, u_, d_h)  # (n, 2I)
        d_sq = sq_norm_last(d_out)  # (n,)
        s = torch.zeros_like(d_sq)
        if m.down_trains:
            s = s + d_sq * sq_norm_last(h.detach())
        if m.down_bias:
            s = s + d_sq
        if m.up_trains:
            s = s + m.up_sq(d_u) * x_sq[tok]
        if m.up_bias:
            s = s + sq_norm_last(d_u)
        out.index_add_(0, tok, s)
    return out


def glu(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """act(gate) ⊙ up on u = [gate | up] (n, 2I) -> (n, I)."""
    def fn(u: torch.Tensor) -> torch.Tensor:
        gate, up = u.chunk(2, dim=-1)
        return act(gate) * up
    return fn


__all__ = ["ExpertMath", "glu", "routed_scores"]
