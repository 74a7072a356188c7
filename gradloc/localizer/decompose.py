"""The decomposition probe: every loss term's exact, additive share of the spike on one micro-batch.

For loss term t, c_t = ⟨∇θ ℓ_t, ∇⟩ with ∇ the step's stored gradient. By linearity, Σ_{t∈S} c_t =
⟨∇_S, ∇⟩ for any token set S, so a sample's or a span's share of ‖∇‖² is the sum of its tokens' c_t
divided by ‖∇‖² — over *every* parameter, with no per-layer rule involved. Sums of per-token
*squared* scores cannot do that: a gradient coherent across many tokens of one sample (a repeated
run, a document in another script) has a large norm made of tokens that are each unremarkable.

How, in one probe plus two forward-only passes: ℓ_t depends on θ only through y_t, the output of the
*exact* layer (the loss head: nothing mixes positions after it) at position t. By the chain rule,
c_t = ⟨∂L/∂y_t, ẏ_t⟩ where ẏ_t = dy_t(θ + ε∇)/dε at ε = 0. A central difference of two forward passes
at θ ± ε∇ gives ẏ for every position (error O(ε²) + rounding, ``REL_STEP``); the parameters are put back bitwise from a copy.
Then one ordinary probe (the micro-batch's loss tokens) runs forward and backward, and a tensor hook on
the head's output takes Σ_v ∂L/∂y_tv · ẏ_tv per position without keeping the (B, T, V) gradient. The
probe's gradient also measures the micro-batch's own share exactly, and the identity Σ_t c_t =
⟨∇_mb, ∇⟩ checks the decomposition (``Decomposition.closure_error``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gradloc.localizer.probes import Grads, ProbeSession, dot, grad_norm

# ε·‖∇‖ = REL_STEP·‖θ‖. The central difference errs by O(ε²) (curvature) plus O(u/ε) (rounding, u the
# unit roundoff): 1e-3 in float32 (both ~1e-4 relative, measured against brute force in the tests), 1e-6 in float64.
REL_STEP = {torch.float64: 1e-6}
REL_STEP_DEFAULT = 1e-3


@dataclass(frozen=True, kw_only=True)
class Decomposition:
    c: np.ndarray  # (B·T,) float64: each position's ⟨∇ℓ_t, ∇⟩ / ‖∇‖² (0 where the mask is off)
    grad: Grads  # ∇ of the probed tokens (unscaled, as the closure computes it)
    loss: float  # their loss
    explained: float  # ⟨∇_mb, ∇⟩ / ‖∇‖² of the probed tokens, from the probe's gradient
    closure_error: float  # |Σ c − explained| / max(|explained|, 1e-12): the first-order check


def decompose(session: ProbeSession, micro_batch: int, mask: torch.Tensor, stored: Grads, inv_scale: float,
              total_sq: float, head: nn.Module) -> Decomposition:
    """Decompose the loss of ``mask`` (B×T bool) of ``micro_batch`` against ``stored`` (the training
    gradient, times ``inv_scale`` to unscale it; ‖∇‖² = ``total_sq``). Runs inside ``session``: the
    training gradients, buffers, RNG and gradloc's hooks are already set aside."""
    params = session.params
    pairs = [(p, g) for p, g in zip(params, stored) if g is not None]
    theta = grad_norm([p.detach() for p, _ in pairs])
    if total_sq <= 0 or not math.isfinite(total_sq) or theta == 0:
        raise ValueError("nothing to decompose against (a zero or non-finite gradient)")
    rel = REL_STEP.get(pairs[0][0].dtype, REL_STEP_DEFAULT) if all(p.dtype == pairs[0][0].dtype for p, _ in pairs) \
        else REL_STEP_DEFAULT
    eps = rel * theta / math.sqrt(total_sq) * inv_scale  # the step along the *stored* (scaled) tensors
    ydot = _directional(session, micro_batch, mask, pairs, eps, head, inv_scale)
    parts: list[torch.Tensor] = []

    def take(g: torch.Tensor) -> None:
        prod = g * ydot.to(g.dtype) if g.dtype == torch.float64 else g.float() * ydot.float()  # (*lead, V)
        parts.append(prod.sum(-1, dtype=torch.float64).reshape(-1))  # (*lead, V) -> (lead numel,)

    def hook(_m: nn.Module, _i: object, out: object) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(take)

    handle = head.register_forward_hook(hook)
    try:
        grad = session.add_to([None] * len(params), micro_batch, mask)
    finally:
        handle.remove()
    if len(parts) != 1 or parts[0].numel() != mask.numel():
        raise ValueError(f"the loss head's output gradient did not match the micro-batch ({len(parts)} call(s))")
    c = parts[0].cpu().numpy() / total_sq
    explained = dot(grad, stored, inv_scale) / total_sq
    err = abs(float(c.sum()) - explained) / max(abs(explained), 1e-12)
    return Decomposition(c=c, grad=grad, loss=session.losses[-1], explained=explained, closure_error=err)


def _directional(session: ProbeSession, micro_batch: int, mask: torch.Tensor, pairs: list, eps: float,
                 head: nn.Module, inv_scale: float) -> torch.Tensor:
    """ẏ = (y(θ + ε∇) − y(θ − ε∇)) / 2ε at the head's output, in its dtype, (*lead, V); θ restored bitwise.
    Memory at a spike: one copy of the parameters and two head outputs of one micro-batch (logits-sized)."""
    outs: list[torch.Tensor] = []

    def grab(_m: nn.Module, _i: object, out: object) -> None:
        if isinstance(out, torch.Tensor):  # the head's own dtype: y+ − y− of close values is exact in it
            outs.append(out.detach().clone())

    saved = [p.detach().clone() for p, _ in pairs]  # one copy of the parameters, for the bitwise restore
    handle = head.register_forward_hook(grab)
    meta = session.metas[micro_batch]
    try:
        with torch.no_grad():
            for sign in (1.0, -1.0):
                for p, g in pairs:
                    p.add_(g.to(p.dtype), alpha=sign * eps)
                meta.rng.restore()
                session.closure(micro_batch, mask)
                for p, s in zip((p for p, _ in pairs), saved):
                    p.copy_(s)
    finally:
        handle.remove()
        with torch.no_grad():
            for (p, _), s in zip(pairs, saved):
                p.copy_(s)
    if len(outs) != 2 or outs[0].shape != outs[1].shape:
        raise ValueError("the loss head did not run exactly once per forward pass")
    # d y / d(step along the unscaled ∇) = (y+ − y−) / (2 ε / inv_scale)
    return (outs[0] - outs[1]) * (inv_scale / (2.0 * eps))
