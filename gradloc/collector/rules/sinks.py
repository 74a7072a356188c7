"""Attention sinks (gpt-oss: a learned logit per head, ``sinks`` (H,), appended to every query row's
attention logits and dropped after the softmax).

For query position (b, t) and head h the sink's probability is p_s = 1 − Σ_j p_j (the row's
weights without the sink), and since the sink column carries no value, ∂L/∂s_h through that row is
−p_s ⟨∂L/∂o_h, o_h⟩ with o_h = Σ_j p_j v_j the head's attention output (the input of ``o_proj``).
Position (b, t) routes that (H,) vector into ∇sinks: its score is the vector's squared norm.

The forward hook (the module is called with keywords: ``wants_kwargs``) recomputes v from the
layer's input with ``v_proj``'s weights and o = weights · v from the attention weights the module
returns; ∂L/∂o = g W_o comes from the gradient at the module's output. That needs the weights:
eager attention returns them; SDPA and flash return None, and dropout on the weights would make
p_s wrong — then the call is not scored (its gradient unattributed). Checked against per-position
autograd (tests/collector/rules/test_moe.py).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradloc.collector.rules.registry import feature_lead, register_duck_rule


def has_sinks(module: nn.Module) -> bool:
    sinks, o, v = getattr(module, "sinks", None), getattr(module, "o_proj", None), getattr(module, "v_proj", None)
    return (isinstance(sinks, nn.Parameter) and sinks.dim() == 1 and isinstance(o, nn.Linear)
            and isinstance(v, nn.Linear) and isinstance(getattr(module, "head_dim", None), int))


@register_duck_rule(has_sinks)
class AttentionSinksRule:
    compilable = False  # needs the attention weights and a recomputation: unscored inside a graph
    wants_kwargs = True

    def call_args(self, args: tuple, kwargs: dict) -> tuple:
        hidden = args[0] if args else kwargs.get("hidden_states")
        return (hidden,) if isinstance(hidden, torch.Tensor) else ()

    def output(self, out: object) -> object:
        return out[0] if isinstance(out, tuple) and out else out

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        return feature_lead(y)  # (B, T, hidden) -> (B, T)

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
        raise ValueError("the sinks rule needs the attention weights: capture_call")

    def capture_call(self, module: nn.Module, args: tuple, y: torch.Tensor, whole: Any = None) -> Any:
        weights = whole[1] if isinstance(whole, tuple) and len(whole) > 1 else None
        if not isinstance(weights, torch.Tensor):
            raise ValueError("no attention weights returned (SDPA/flash attention): sinks not scorable")
        if module.training and float(getattr(module, "attention_dropout", 0.0) or 0.0) > 0:
            raise ValueError("dropout on the attention weights: the sink's probability is not 1 − Σ weights")
        hidden = args[0]
        B, T = hidden.shape[:2]
        D = module.head_dim
        v = F.linear(hidden, module.v_proj.weight, module.v_proj.bias)  # (B, T, kvH·D), no hook
        v = v.view(B, T, -1, D).transpose(1, 2)  # (B, T, kvH, D) -> (B, kvH, T, D)
        H = weights.shape[1]
        v = v.repeat_interleave(H // v.shape[1], dim=1)  # (B, kvH, T, D) -> (B, H, T, D), as repeat_kv
        o = weights.to(v.dtype) @ v  # (B, H, T, T) @ (B, H, T, D) -> (B, H, T, D)
        p_sink = 1.0 - weights.float().sum(-1)  # (B, H, T)
        return o, p_sink

    def score(self, module: nn.Module, saved: Any, g: torch.Tensor) -> torch.Tensor:
        o, p_sink = saved
        B, H, T, D = o.shape
        if not module.sinks.requires_grad:
            return torch.zeros(B, T, device=g.device)
        g_o = (g @ module.o_proj.weight.to(g.dtype)).view(B, T, H, D).transpose(1, 2)  # (B, T, H·D) -> (B, H, T, D)
        c = -p_sink * (g_o.float() * o.float()).sum(-1)  # (B, H, T): ∂L/∂sinks through each query row
        return c.pow(2).sum(1)  # (B, H, T) -> (B, T)
