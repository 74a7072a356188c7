"""Fused MoE experts (transformers 5.x ``*Experts``: Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss), under
every experts implementation (eager, batched_mm, grouped_mm: the hooks see the module's call, not
its kernels).

The module holds every expert in 3D parameters: ``gate_up_proj`` (E, 2I, H) and ``down_proj``
(E, H, I) (gpt-oss transposed, (E, H, 2I) and (E, I, H), with per-expert biases and interleaved
gate/up columns), and is called as ``experts(x (N, H), top_k_index (N, K), top_k_weights (N, K))``,
returning y_p = Σ_k w_pk · f_{e_pk}(x_p). The score is ``rules/routed.py``'s, with ε taken by
autograd through the module's own activation (``act_fn`` on the two halves, or gpt-oss's
``_apply_gate``): about the cost of the experts' forward once more, on flagged and healthy steps
alike. Checked against per-token autograd for every layout and implementation
(tests/collector/rules/test_moe.py). The routing weights' gradient reaches the router
(rules/router.py). Not under torch.compile (the recomputation is data-dependent): there the experts
stay unscored, their gradient unattributed.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from gradloc.collector.rules.registry import feature_lead, register_duck_rule
from gradloc.collector.rules.routed import ExpertMath, glu, routed_scores


def _layout(module: nn.Module) -> str | None:
    """"rows" (y = x Wᵀ: gate_up (E, 2I, H), down (E, H, I)) or "cols" (y = x W: gpt-oss), else None.
    transformers' ``use_experts_implementation`` flags are read when present (``is_transposed``; no
    gate or a norm after each expert: a layout this rule does not know), else the shapes decide."""
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == dn.dim() == 3):
        return None
    if gu.shape[0] != dn.shape[0] or getattr(module, "has_post_expert_norm", False) \
            or not getattr(module, "has_gate", True):
        return None
    rows = gu.shape[2] == dn.shape[1] and gu.shape[1] == 2 * dn.shape[2]
    cols = gu.shape[1] == dn.shape[2] and gu.shape[2] == 2 * dn.shape[1]
    flag = getattr(module, "is_transposed", None)
    if flag is not None:
        return ("cols" if cols else None) if flag else ("rows" if rows else None)
    return "rows" if rows else "cols" if cols else None


def _activation(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if callable(getattr(module, "_apply_gate", None)):  # gpt-oss: interleaved gate/up, clamped GLU
        return module._apply_gate
    act = getattr(module, "act_fn", None)
    return glu(act) if callable(act) else None


def is_fused_experts(module: nn.Module) -> bool:
    return _layout(module) is not None and _activation(module) is not None


def _bias(module: nn.Module, name: str) -> torch.Tensor | None:
    b = getattr(module, name, None)
    return b if isinstance(b, nn.Parameter) and b.requires_grad else None


@register_duck_rule(is_fused_experts)
class FusedExpertsRule:
    compilable = False  # data-dependent recomputation: unscored inside a compiled graph

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        return feature_lead(y)  # (N, H) -> (N,)

    def capture_call(self, module: nn.Module, args: tuple, y: torch.Tensor, whole: Any = None) -> Any:
        if len(args) < 3:
            raise ValueError("experts called without (hidden, top_k_index, top_k_weights) positionally")
        x, idx, w = args[0], args[1], args[2]
        return x.detach(), idx.detach(), w.detach()

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
        raise ValueError("the experts rule needs the routing: capture_call")

    def score(self, module: nn.Module, saved: Any, g: torch.Tensor) -> torch.Tensor:
        x, idx, w = saved  # (N, H), (N, K), (N, K)
        rows = _layout(module) == "rows"
        gu, dn = module.gate_up_proj, module.down_proj
        gu_b = getattr(module, "gate_up_proj_bias", None)

        def up(e: int, xe: torch.Tensor) -> torch.Tensor:
            u = xe @ (gu[e].t() if rows else gu[e])  # (n, H) -> (n, 2I)
            return u + gu_b[e] if gu_b is not None else u

        math = ExpertMath(n_experts=gu.shape[0], up=up, act=_activation(module),
                          down_t=lambda e, d: d @ (dn[e] if rows else dn[e].t()),  # (n, H) -> (n, I)
                          down_trains=dn.requires_grad,
                          down_bias=_bias(module, "down_proj_bias") is not None, up_trains=gu.requires_grad,
                          up_bias=_bias(module, "gate_up_proj_bias") is not None)
        return routed_scores(x, idx, w, g, math)
