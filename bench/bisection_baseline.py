"""GradLoc-style baseline: micro-batch scan, then token bisection with masked-loss probes.

This wraps :func:`gradloc.localizer.bisection.bisect` (the same code gradloc falls back to) so that
it runs on the very step gradloc just handled: same data, same model state, and inside a
:class:`gradloc.localizer.ProbeSession`, so the training gradients are moved aside during the
probes and put back afterwards.

1. micro-batch scan: one probe per micro-batch over all its loss tokens;
2. bisection: split a hot token set in halves, probe both halves (2 probes per split), recurse
   into the hot halves until single tokens remain. ``worst_only=True`` searches only the worst hot
   micro-batch, as published GradLoc does; ``worst_only=False`` searches every hot micro-batch.

A subset of n tokens is hot when its gradient norm exceeds κ·σ·√n with σ = healthy_norm / √N
(N = loss tokens in the step; healthy_norm = the detector's EMA mean of the global norm): the
√-scaled τ of GradLoc. A probe is one forward+backward over one micro-batch, counted exactly as
gradloc counts its own.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gradloc.collector.batch import MicroBatchMeta
from gradloc.localizer import ProbeSession
from gradloc.localizer.bisection import bisect, sqrt_threshold
from gradloc.localizer.probes import Grads, grad_norm

Key = tuple[int, int, int]  # (micro_batch, sample, position)


@dataclass(frozen=True)
class BaselineResult:
    culprits: tuple[Key, ...]
    probes: int
    exhausted: bool
    hot_micro_batches: int  # micro-batches above τ in the scan


def gradloc_bisection(model: nn.Module, params: Sequence[nn.Parameter], metas: Sequence[MicroBatchMeta],
                      loss_masks: Sequence[torch.Tensor], probe: Callable[[int, torch.Tensor], torch.Tensor],
                      healthy_norm: float, kappa: float, *, worst_only: bool, budget: int = 512,
                      suspend: Callable[[bool], None] = lambda on: None) -> BaselineResult:
    """Run the baseline on the current step; ``probe(i, mask)`` is the training loss of micro-batch i
    restricted to ``mask`` (B×T bool), the same closure gradloc gets."""
    sizes = [m.batch * m.seq for m in metas]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    groups = [np.flatnonzero(mask.reshape(-1).cpu().numpy()) + offsets[i] for i, mask in enumerate(loss_masks)]
    n_tokens = max(sum(len(g) for g in groups), 1)
    threshold = sqrt_threshold(healthy_norm / math.sqrt(n_tokens), kappa)
    hot = 0

    with ProbeSession(model, params, metas, probe, suspend) as session:
        def grad_of(m: int, flats: np.ndarray) -> Grads:
            meta = metas[m]
            mask = np.zeros(meta.batch * meta.seq, dtype=bool)
            mask[np.asarray(flats) - offsets[m]] = True
            return session.grad(meta.index, torch.from_numpy(mask.reshape(meta.batch, meta.seq)))

        def counting_grad_of(m: int, flats: np.ndarray) -> Grads:
            nonlocal hot
            g = grad_of(m, flats)
            if len(flats) == len(groups[m]):  # the micro-batch scan
                hot += int(grad_norm(g) > threshold(len(flats)))
            return g

        res = bisect(groups, counting_grad_of, threshold, budget, worst_only=worst_only)
        assert res.probes == session.count
    keys = []
    for flat in res.culprits:
        m = int(np.searchsorted(offsets, flat, side="right")) - 1
        local = int(flat - offsets[m])
        keys.append((metas[m].index, local // metas[m].seq, local % metas[m].seq))
    return BaselineResult(tuple(keys), res.probes, res.exhausted, hot)
