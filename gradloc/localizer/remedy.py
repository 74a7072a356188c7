"""The opt-in remedy: change a located spike step's gradient before the optimizer sees it.

Observability comes first: nothing here runs unless ``WatchConfig.remedy`` asks for it, and a
step qualifies only when its spike was *located* (a verified culprit set).

- ``drop_culprits``: ∇ ← ∇ − ∇_C, where ∇_C is the culprits' exact gradient that the verification
  probes already computed (no extra pass). The optimizer then makes the update it would have made
  had the culprit tokens been masked out of the loss. Needs the probes: a culprit set that was
  not verified by a probe (no closure; a non-finite gradient located without probes) is refused.
- ``skip_step``: every gradient is set to None, so ``optimizer.step()`` changes neither parameters
  nor optimizer state — what users do today (for comparison). Not with a GradScaler: its
  ``step()`` asserts that the optimizer has gradients.

A refusal changes nothing and says why in the incident's :class:`~gradloc.records.Remedy`.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from gradloc.localizer.probes import Grads
from gradloc.records import Localization, Remedy


def apply_remedy(action: str, loc: Localization | None, culprit_grad: Grads | None,
                 params: Sequence[torch.nn.Parameter], grad_scale: float, has_scaler: bool,
                 unnamed: int = 0) -> Remedy:
    """Apply ``action`` to the params' ``.grad`` (which carry ``grad_scale``, 1.0 once unscaled); ``unnamed``:
    tokens of the verified set that ∇_C holds but the localization does not name (``naming.py``)."""
    norm = loc.global_norm if loc is not None else math.nan
    why = _refusal(action, loc, culprit_grad, has_scaler)
    if why:
        return Remedy(action, False, norm, None, why)
    assert loc is not None
    if action == "skip_step":
        for p in params:
            p.grad = None
        return Remedy(action, True, norm, 0.0, "every gradient set to None: the optimizer step changes nothing")
    assert culprit_grad is not None
    with torch.no_grad():
        for p, g_c in zip(params, culprit_grad):
            if p.grad is not None and g_c is not None:
                p.grad.sub_(g_c.to(p.grad.dtype), alpha=grad_scale)
    return Remedy(action, True, norm, loc.norm_without_culprits,
                  f"∇ − ∇_C: {len(loc.culprits)} culprit token(s)"
                  f"{f' and {unnamed} more of the verified set, not named,' if unnamed else ''} dropped from the update")


def _refusal(action: str, loc: Localization | None, culprit_grad: Grads | None, has_scaler: bool) -> str:
    if loc is None:
        return "the spike kinds of this step are not localized (e.g. a non-finite loss or divergence alone)"
    if loc.status != "located":
        return f"not applied to a {loc.status} spike: only a located culprit set qualifies"
    if action == "skip_step":
        return "skip_step is not supported with a GradScaler (its step() needs gradients)" if has_scaler else ""
    if culprit_grad is None or loc.probes == 0 or loc.explained_share is None:
        return "the culprits were not verified by a probe, so ∇_C is unknown"
    if loc.norm_without_culprits is not None and loc.norm_without_culprits >= loc.global_norm:
        return "dropping the culprits would not lower ‖∇‖ (they point against the rest of the gradient)"
    return ""
