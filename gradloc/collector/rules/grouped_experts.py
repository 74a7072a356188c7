"""torchtitan-style grouped experts (``GroupedExperts``: 3D ``w1_EFD`` (E, F, D), ``w3_EFD`` (E, F, D),
``w2_EDF`` (E, D, F); older releases name them ``w1``/``w3``/``w2``), duck-typed: torchtitan is never imported.

f_e(x) = w2[e] (silu(w1[e] x) ⊙ w3[e] x), computed by ``torch._grouped_mm`` on tokens already sorted by
expert: the experts module itself never sees which token is which. The routing lives in its parent
(torchtitan 0.3's ``RoutedExperts``: a token dispatcher and ``inner_experts``), called as
``routed(x (B, L, D), topk_scores (B, L, K), topk_expert_ids (B, L, K), num_tokens_per_expert (E,))`` and
returning Σ_k s_pk · f_{e_pk}(x_p) (B, L, D): the scores multiply the experts' outputs after the experts, as
in transformers' fused experts. So the hook goes on that parent's call (``site``), the statistics stay the
experts module's, and the score is ``rules/routed.py``'s with up = [w1 | w3] and down = w2.

torchtitan runs the experts' matmuls in bf16; the score recomputes them in the parameters' dtype (an
attribution: the ranking, not the last bits). Under expert parallelism the parent holds E/ep experts and
sees only its own rank's tokens, whose experts may live elsewhere: an index outside the local experts
is skipped here (those tokens' share stays unscored).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradloc.collector.rules.registry import feature_lead, register_duck_rule, sq_norm_last
from gradloc.collector.rules.routed import ExpertMath, glu, routed_scores
from gradloc.collector.shards import local

_NAMES = (("w1_EFD", "w3_EFD", "w2_EDF"), ("w1", "w3", "w2"))


def weights(module: nn.Module) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter] | None:
    """(w1, w3, w2) of a grouped-experts module, or None when it is not one."""
    for names in _NAMES:
        w1, w3, w2 = (getattr(module, n, None) for n in names)
        if all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in (w1, w3, w2)):
            E, F_, D = w1.shape
            if tuple(w3.shape) == (E, F_, D) and tuple(w2.shape) == (E, D, F_):
                return w1, w3, w2
    return None


def is_grouped_experts(module: nn.Module) -> bool:
    return weights(module) is not None and not hasattr(module, "gate_up_proj")


@register_duck_rule(is_grouped_experts)
class GroupedExpertsRule:
    compilable = False  # data-dependent recomputation: unscored inside a compiled graph

    def site(self, module: nn.Module, parent: nn.Module | None) -> nn.Module | None:
        """The module whose call carries the routing: the parent that holds this one as ``inner_experts``."""
        if parent is not None and getattr(parent, "inner_experts", None) is module:
            return parent
        return None

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        return feature_lead(y)  # (B, L, D) -> (B, L)

    def capture_call(self, module: nn.Module, args: tuple, y: torch.Tensor, whole: Any = None) -> Any:
        if len(args) < 3:
            raise ValueError("routed experts called without (x, topk_scores, topk_expert_ids) positionally")
        x, w, idx = args[0], args[1], args[2]
        D, K = x.shape[-1], idx.shape[-1]
        return x.detach().reshape(-1, D), idx.detach().reshape(-1, K), w.detach().reshape(-1, K)  # (T, D), (T, K)

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
        raise ValueError("the grouped-experts rule needs the routing: capture_call")

    def score(self, module: nn.Module, saved: Any, g: torch.Tensor) -> torch.Tensor:
        x, idx, w = saved  # (T, D), (T, K), (T, K)
        p1, p3, p2 = weights(module)
        w1, w3, w2 = local(p1), local(p3), local(p2)
        F_ = w1.shape[1]
        dtype = w1.dtype

        def up(e: int, xe: torch.Tensor) -> torch.Tensor:
            return torch.cat([xe.to(dtype) @ w1[e].t(), xe.to(dtype) @ w3[e].t()], dim=-1)  # (n, D) -> (n, 2F)

        def up_sq(eps: torch.Tensor) -> torch.Tensor:  # the trained halves of ε = [ε_w1 | ε_w3]
            return (sq_norm_last(eps[:, :F_]) if p1.requires_grad else 0) + \
                (sq_norm_last(eps[:, F_:]) if p3.requires_grad else 0)

        math = ExpertMath(n_experts=w1.shape[0], up=up, act=glu(F.silu), down_t=lambda e, d: d @ w2[e],  # (n, D) -> (n, F)
                          down_trains=p2.requires_grad, up_trains=p1.requires_grad or p3.requires_grad, up_sq=up_sq)
        g2 = g.reshape(-1, g.shape[-1])  # (B, L, D) -> (T, D)
        return routed_scores(x, idx, w, g2, math).reshape(g.shape[:-1])  # (T,) -> (B, L)
