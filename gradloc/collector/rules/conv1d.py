"""Hugging Face ``Conv1D`` (GPT-2, GPT, …): y_p = a_p W + b with W of shape (nx, nf), i.e. a Linear
layer with the weight transposed. Position p routes a_p g_pᵀ into ∇W (Frobenius norm ‖a_p‖·‖g_p‖) and
g_p into ∇b, so the score is the Linear one (:func:`affine_score`).

Recognised by shape, without importing transformers: a class named ``Conv1D`` with a 2-D ``weight``
Parameter of shape (nx, nf) matching its ``nf`` (and ``nx`` when it has one). Each call is checked
against the weight: an input or output whose feature size is not (nx, nf) is some other layer that
happens to share the name, and the call is counted as a hook error instead of scored wrongly.
"""
from __future__ import annotations

import torch
from torch import nn

from gradloc.collector.rules.linear import affine_score
from gradloc.collector.rules.registry import feature_lead, register_duck_rule, sq_norm_last


def is_hf_conv1d(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    if type(module).__name__ != "Conv1D" or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        return False
    nf, nx = getattr(module, "nf", None), getattr(module, "nx", weight.shape[0])
    return nf == weight.shape[1] and nx == weight.shape[0]


@register_duck_rule(is_hf_conv1d)
class Conv1DRule:
    input_only = True  # capture is ‖x_p‖²: shared by modules called on the same input

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        nx, nf = module.weight.shape
        if x.shape[-1:] != (nx,) or y.shape[-1:] != (nf,):
            raise ValueError(f"Conv1D with weight ({nx}, {nf}) mapped {tuple(x.shape)} to {tuple(y.shape)}")
        return feature_lead(y)

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return sq_norm_last(x)  # (*lead, nx) -> (*lead)

    def score(self, module: nn.Module, saved: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return affine_score(module.weight, getattr(module, "bias", None), saved, g)
