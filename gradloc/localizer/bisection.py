"""GradLoc-style bisection with masked-loss probes (the fallback, and the benchmark's baseline).

1. micro-batch scan: one probe per micro-batch over all its loss tokens;
2. in each hot micro-batch (only the worst one with ``worst_only``, as GradLoc does), split the
   token set in halves, probe both halves, recurse into hot halves until single tokens remain.

A subset of n tokens is *hot* when its gradient norm exceeds ``threshold(n)``; with isotropic noise
of per-token norm σ a healthy subset has norm ≈ σ√n, so the threshold is κ·σ·√n (docs/DESIGN-NOTES.md,
"Verification").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from gradloc.localizer.probes import Grads, add_into, grad_norm

GradOf = Callable[[int, np.ndarray], Grads]  # (micro-batch position, flat token indices) -> ∇


@dataclass
class BisectionResult:
    culprits: list[int] = field(default_factory=list)  # flat indices
    grad: Grads | None = None  # Σ of the culprits' own gradients (one copy, summed in place)
    norms: list[float] = field(default_factory=list)
    probes: int = 0
    exhausted: bool = False  # the budget ran out before the search finished


def sqrt_threshold(sigma_token: float, kappa: float) -> Callable[[int], float]:
    return lambda n: kappa * sigma_token * math.sqrt(max(n, 1))


def bisect(groups: Sequence[np.ndarray], grad_of: GradOf, threshold: Callable[[int], float],
           budget: int, worst_only: bool = False) -> BisectionResult:
    res = BisectionResult()
    scanned: list[tuple[float, int]] = []
    for m, flats in enumerate(groups):
        if res.probes >= budget:
            res.exhausted = True
            break
        if len(flats) == 0:
            continue
        g = grad_of(m, flats)
        res.probes += 1
        n = grad_norm(g)
        if n > threshold(len(flats)):
            if len(flats) == 1:
                _add(res, int(flats[0]), g, n)
            else:
                scanned.append((n, m))
    scanned.sort(reverse=True)
    if worst_only:
        scanned = scanned[:1]
    stack = [(m, np.asarray(groups[m])) for _, m in reversed(scanned)]
    while stack:
        if res.probes + 2 > budget:
            res.exhausted = True
            break
        m, flats = stack.pop()
        half = len(flats) // 2
        for part in (flats[:half], flats[half:]):
            g = grad_of(m, part)
            res.probes += 1
            n = grad_norm(g)
            if n <= threshold(len(part)):
                continue
            if len(part) == 1:
                _add(res, int(part[0]), g, n)
            else:
                stack.append((m, part))
    return res


def _add(res: BisectionResult, flat: int, g: Grads, n: float) -> None:
    res.culprits.append(flat)
    res.grad = list(g) if res.grad is None else add_into(res.grad, g)
    res.norms.append(n)
