"""The GradLoc-style fallback on one rank: bisection when attribution is unavailable or on request.

Runs per ``LocalizerConfig.bisection`` (``"fallback"``: more than half of ‖∇‖² outside per-token rules;
``"on_failure"``: also when the token candidates fail verification). Across ranks it does not run.
"""
from __future__ import annotations

import math

import numpy as np

from gradloc.localizer.bisection import bisect, sqrt_threshold
from gradloc.localizer.context import LocalizeResult, explained_of, loss_fields, probe_into
from gradloc.localizer.diffuse import describe, sample_shares
from gradloc.localizer.probes import Grads
from gradloc.localizer.runner import Runner
from gradloc.localizer.spans import build_culprits, build_spans
from gradloc.records import Level, Localization, Method, Status


def bisect_step(run: Runner, why: str) -> LocalizeResult:
    """Bisection over ``run``'s step on one rank, in its open probe session (``Runner.session``)."""
    view, stored, session, ctx, cfg, decode = run.view, run.stored, run.session, run.ctx, run.cfg, run.decode
    n_tokens = max(int(view.eligible.sum()), 1)
    reference = ctx.healthy_norm if ctx.healthy_norm else stored.norm
    threshold = sqrt_threshold(reference / math.sqrt(n_tokens), cfg.bisection_sigma)
    groups = [np.flatnonzero(view.eligible[a:b]) + a for a, b in zip(view.offsets, view.offsets[1:])]
    single_loss: dict[int, float] = {}

    def grad_of(m: int, flats: np.ndarray) -> Grads:
        g = probe_into(session, view, [None] * len(stored.grads), m, flats)
        if len(flats) == 1:
            single_loss[int(flats[0])] = session.losses[-1]
        return g

    res = bisect(groups, grad_of, threshold, max(cfg.bisection_budget - session.count, 1))
    note = f"{why}; bisection" + (" stopped at its probe budget" if res.exhausted else "")
    samples = sample_shares(view, None, 0)
    n = sum(m.n_samples for m in view.metas)
    if res.grad is None:
        return LocalizeResult(run.empty(Method.BISECTION, Status.DIFFUSE, session.count,
                                        f"{note}: no token subset above the noise threshold; {describe(samples, n)}",
                                        samples))
    cands = np.asarray(res.culprits, dtype=np.int64)
    explained, c_norm, without = explained_of(stored, res.grad)
    loss_c = sum(single_loss.get(int(c), 0.0) for c in cands)
    if not run.verified(explained, loss_c):
        return LocalizeResult(run.empty(
            Method.BISECTION, Status.DIFFUSE, session.count,
            f"{note}: {cands.size} hot token(s) explain only {explained:.2f} of ‖∇‖²; {describe(samples, n)}",
            samples))
    w = np.asarray(res.norms) ** 2
    shares = explained * w / w.sum() if math.isfinite(explained) and w.sum() > 0 else w * np.nan
    culprits = build_culprits(view, [int(c) for c in cands], [float(s) for s in shares], decode)
    spans = build_spans(view, culprits, decode, cfg.context_tokens)
    ls, lw = loss_fields(ctx, loss_c)
    out = Localization(step=run.step, method=Method.BISECTION, status=Status.LOCATED,
                       level=Level.SPAN if any(s.end - s.start > 1 for s in spans) else Level.TOKEN,
                       probes=session.count, explained_share=explained, global_norm=stored.norm, culprit_norm=c_norm,
                       norm_without_culprits=without, culprits=culprits, spans=spans,
                       micro_batch_shares=view.micro_batch_shares(), unattributed_share=view.unattributed_share,
                       loss_share=ls, loss_without_culprits=lw, note=note, samples=samples)
    return LocalizeResult(out, res.grad if run.keep_grad else None)
