"""Shared brute-force reference for the per-token rule tests (never reuses a rule's formula)."""
from __future__ import annotations

import math

import torch
from hypothesis import settings
from torch import nn
from torch.func import functional_call

from gradloc.collector.rules import rule_for

SETTINGS = settings(max_examples=25, deadline=None)


def per_position_reference(module: nn.Module, x: torch.Tensor, g: torch.Tensor, n_feat: int) -> torch.Tensor:
    """(*lead) float64: Σ over trainable params of ‖∇θ_p ⟨y_p, g_p⟩‖², with a private copy θ_p of the
    parameters for every position p. ``n_feat`` is the number of feature dims of ``x`` (0 for ids)."""
    lead = tuple(x.shape[: x.dim() - n_feat])
    n = math.prod(lead)
    xs = x.reshape(n, *x.shape[len(lead):])  # (*lead, *feat) -> (n, *feat)
    gs = g.reshape(n, *g.shape[len(lead):])  # (*lead, *out) -> (n, *out)
    trainable = {k: p for k, p in module.named_parameters() if p.requires_grad}
    frozen = {k: p.detach() for k, p in module.named_parameters() if not p.requires_grad}
    out = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        if not trainable:
            break
        copies = {k: p.detach().clone().requires_grad_(True) for k, p in trainable.items()}
        y_i = functional_call(module, {**frozen, **copies}, (xs[i:i + 1],))
        grads = torch.autograd.grad((y_i * gs[i:i + 1].to(y_i.dtype)).sum(), list(copies.values()))
        out[i] = sum(gr.double().pow(2).sum() for gr in grads)
    return out.reshape(lead)


def rule_score(module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """(rule, lead shape, y, score) of the registered rule for ``module`` with upstream gradient g."""
    rule = rule_for(module)
    y = module(x)
    lead = rule.lead_shape(module, x, y)
    with torch.no_grad():
        saved = rule.capture(module, x, y)
        score = rule.score(module, saved, g.reshape(y.shape).to(y.dtype))
    return rule, lead, y, score


class LlamaRMSNorm(nn.Module):
    """Verbatim shape of transformers' LlamaRMSNorm (float32 statistics, cast back before the weight)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)
