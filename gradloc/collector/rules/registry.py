"""Per-token rule registry, keyed by module type (as opacus keys its per-sample rules).

A rule turns what autograd already has at one module into a per-position score: the squared
Frobenius norm of the parameter-gradient contribution routed through each position
(docs/DESIGN-NOTES.md, "Per-token scores"). It is split in two so that nothing extra stays alive
between forward and backward:

- ``capture(module, x, y)`` runs in the forward hook under ``no_grad`` and returns a small saved
  state (e.g. ‖a_p‖², shape ``lead``) or a reference to a tensor autograd saves anyway;
- ``score(module, saved, g)`` runs in the output's tensor hook with g = ∂L/∂y and returns a float32
  tensor of shape ``lead`` (every dimension of y but the feature ones).

A rule whose ``capture`` reads only ``x`` (not the module, not y) says so with ``input_only = True``: modules
called one after another on the same input (a block's q/k/v projections, its gate and up projections) then
share one capture (``scores_buffer.MicroBatchScores.capture``).

Modules without a rule are not ignored: their parameters' gradient norm² is reported as the
*unattributed* share, and the localizer falls back to probe bisection when it is large.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import nn


class TokenRule(Protocol):
    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]: ...

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any: ...

    def score(self, module: nn.Module, saved: Any, g: torch.Tensor) -> torch.Tensor: ...


_BY_TYPE: dict[type, TokenRule] = {}
_BY_PREDICATE: list[tuple[Callable[[nn.Module], bool], TokenRule]] = []


def register_rule(*module_types: type) -> Callable[[type], type]:
    """Class decorator: one instance of the rule serves every listed module type."""

    def deco(cls: type) -> type:
        for t in module_types:  # check every type first: a failed call registers nothing
            if t in _BY_TYPE:
                raise ValueError(f"a per-token rule for {t.__name__} is already registered")
        rule = cls()
        for t in module_types:
            _BY_TYPE[t] = rule
        return cls

    return deco


def register_duck_rule(predicate: Callable[[nn.Module], bool]) -> Callable[[type], type]:
    """Class decorator for module families recognised by shape rather than type (HF RMSNorm)."""

    def deco(cls: type) -> type:
        _BY_PREDICATE.append((predicate, cls()))
        return cls

    return deco


def rule_for(module: nn.Module) -> TokenRule | None:
    """The rule for ``module``; subclasses qualify only if they keep the base class's forward."""
    t = type(module)
    if t in _BY_TYPE:
        return _BY_TYPE[t]
    for base in t.__mro__[1:]:
        if base in _BY_TYPE and t.forward is base.forward:
            return _BY_TYPE[base]
    for predicate, rule in _BY_PREDICATE:
        if predicate(module):
            return rule
    return None


def feature_lead(y: torch.Tensor, n_feature_dims: int = 1) -> tuple[int, ...]:
    """Leading (position) dimensions of an output whose last ``n_feature_dims`` are features."""
    return tuple(y.shape[: y.dim() - n_feature_dims])


_REUSE = threading.local()  # (tensor, its sq_norm_last) while reusing_sq_norm is active in this thread


@contextmanager
def reusing_sq_norm(t: torch.Tensor, sq: torch.Tensor) -> Iterator[None]:
    """Inside, ``sq_norm_last(t)`` of this very tensor (one feature dimension) returns ``sq`` (= its
    ``sq_norm_last``) instead of reducing ``t`` again: one reduction of the loss head's output gradient serves
    both the head's own score and the per-sample surprise (collector/token_hooks.py). Per thread (backward hooks
    may run on the autograd engine's device threads)."""
    prev = getattr(_REUSE, "hit", None)
    _REUSE.hit = (t, sq)
    try:
        yield
    finally:
        _REUSE.hit = prev


def sq_norm_last(t: torch.Tensor, n_dims: int = 1) -> torch.Tensor:
    """Σ of squares over the last ``n_dims`` dimensions, in float32. (*lead, *feat) -> (*lead).

    ``vector_norm(dtype=float32)`` accumulates in float32 without materialising a float copy of a
    bf16/fp16 tensor; ~3× faster than ``.float().pow(2).sum()`` on the LM head's gradient.
    """
    hit = getattr(_REUSE, "hit", None)
    if hit is not None and n_dims == 1 and t is hit[0]:
        return hit[1]
    dims = tuple(range(t.dim() - n_dims, t.dim()))
    if t.dtype == torch.float64:  # vector_norm refuses to narrow float64 -> float32
        return t.pow(2).sum(dim=dims).float()
    return torch.linalg.vector_norm(t, dim=dims, dtype=torch.float32).square()
