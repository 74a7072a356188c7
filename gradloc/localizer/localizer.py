"""Spike -> Localization: one-pass attribution, verified by ≤ max_probes probes — on one rank or W.

One algorithm for every scope (``scope.py``): a single process is W = 1, whose collectives are the
identity. Every rank enters together (a spike is judged on the job's step) and takes the same path,
because every decision comes from gathered values:

1. **Picture** — one ``all_gather`` of each rank's fixed-size summary (``picture.py``): no per-token
   statistics anywhere → ``unavailable``; non-finite scores → ``located`` at the positions where they
   appear; more than half of ‖∇‖² outside per-token rules → bisection (one rank only) or
   ``unavailable``; otherwise the job's token candidates (relative and median thresholds).
2. **Tokens** — rounds of one probe per rank (each rank probes its next candidate micro-batch; under
   a lockstep scope the others take part with nothing to probe), then the scope measures the job's
   ⟨∇_C, ∇⟩ / ‖∇‖² and ℓ_C (``context.verified``). While the step would still be a spike without
   C, rounds *grow* C with the next outliers (a relaxed relative threshold) — into the last probe
   only when C is verified already: that probe is kept for the levels below. A probe left after C
   is verified measures its weakest-scored members, which are not named when they carry less than
   a sample must to be named (``prune.py``). The record names C's carriers (``naming.py``): its runs
   of adjacent tokens up to the cut after which every run is below a tenth of the smallest named one
   and all together below 10% of ‖∇‖², the named runs alone still the answer; the note says what is
   not named, and the explained share, norms and ∇_C stay the whole verified set's.
3. **Below the tokens** (``below.py``) — the sample, span or micro-batch that carries it, with the
   decomposition probe (``decompose.py``), else ``diffuse`` with the measured sample shares.
4. **Records** — every rank builds its own culprits and spans (its rank named when W > 1) and one
   ``all_gather_object`` gives every rank the same localization.

``unverified``: some rank gave no probe closure (attribution shares only).
"""
from __future__ import annotations

import math

import numpy as np
from torch import nn

from gradloc.config import LocalizerConfig
from gradloc.localizer.below import below
from gradloc.localizer.bisect_step import bisect_step
from gradloc.localizer.context import (
    MAX_UNATTRIBUTED,
    LocalizeResult,
    SpikeContext,
    StoredGradient,
)
from gradloc.localizer.diffuse import describe
from gradloc.localizer.runner import Runner
from gradloc.localizer.scope import Scope
from gradloc.localizer.spans import Decode
from gradloc.localizer.token_view import TokenView
from gradloc.localizer.tokens import token_rounds
from gradloc.records import Level, Localization, Method, Status

__all__ = ["Localizer", "LocalizeResult", "SpikeContext", "StoredGradient", "MAX_UNATTRIBUTED"]


class Localizer:
    def __init__(self, cfg: LocalizerConfig, decode: Decode | None) -> None:
        self.cfg, self.decode = cfg, decode

    def localize(self, step: int, view: TokenView | None, stored: StoredGradient, scope: Scope | None,
                 ctx: SpikeContext, *, keep_grad: bool = False, head: nn.Module | None = None,
                 has_probe: bool | None = None) -> LocalizeResult:
        """The one entry, one process or a job's rank alike: ``scope`` is where this rank's probes run and
        combine (``SoloScope`` for one process, ``parallel/scope.py``'s for a job; None: one process without a
        probe closure); ``has_probe``: whether this rank has a probe closure (default: a scope was given);
        ``head``: the view's exact-layer module, for the decomposition probe."""
        probe = has_probe if has_probe is not None else scope is not None
        return run(Runner(self.cfg, self.decode, step, view, stored, scope, ctx, head, keep_grad, probe))


def run(r: Runner) -> LocalizeResult:
    """The algorithm's driver over one :class:`Runner` (module docstring): the picture, the token rounds and their
    growth with pruning and naming (``tokens.py``), or the levels below the tokens (``below.py``), or bisection."""
    pic = r.pic
    if not pic.all_have_view:
        why = "no per-token statistics for this step" if r.solo else \
            "a rank has no per-token statistics for this step"
        return LocalizeResult(r.empty(Method.NONE, Status.UNAVAILABLE, 0, why))
    if pic.nonfinite:
        return LocalizeResult(nonfinite(r))
    if pic.max_unattributed > MAX_UNATTRIBUTED:
        return unattributed(r)
    cands = pic.candidates(r.cfg.candidate_rel_score, r.cfg.candidate_outlier_factor)
    if not pic.all_have_probe or r.scope is None:
        return LocalizeResult(unverified(r, cands))
    with r.probing():
        why = "no token stands out in the attribution scores" if r.solo else \
            "no token stands out in any rank's attribution scores"
        if cands:
            res = token_rounds(r, cands)
            if isinstance(res, LocalizeResult):
                return res
            why = res
        if r.cfg.bisection == "on_failure" and r.solo:
            return bisect_step(r, why)
        return below(r, why)


def nonfinite(r: Runner) -> Localization:
    view = r.view
    bad = np.flatnonzero(view.eligible & ~(np.isfinite(view.scores) & np.isfinite(view.rank_scores)))
    bad = bad[: r.cfg.max_candidates]
    culprits, spans, samples = r.gather_records([int(b) for b in bad], [math.nan] * bad.size)
    note = "non-finite gradient: culprits are the positions where it appears" + \
        ("" if r.solo else ", on the ranks where it appears")
    level = Level.SPAN if any(x.end - x.start > 1 for x in spans) else Level.TOKEN
    return r.record(method=Method.ATTRIBUTION, status=Status.LOCATED, level=level, probes=0,
                       culprits=culprits, spans=spans, samples=samples, note=note)

def unattributed(r: Runner) -> LocalizeResult:
    why = (f"attribution unavailable: {r.pic.max_unattributed:.0%} of ‖∇‖² is in parameters "
           "no per-token rule covers")
    if not r.solo:
        why = why.replace("attribution unavailable:", "attribution unavailable on a rank:") + \
            "; bisection does not run across ranks"
    if r.scope is None or r.cfg.bisection == "off" or not r.solo:
        return LocalizeResult(r.empty(Method.NONE, Status.UNAVAILABLE, 0, why))
    with r.probing():
        return bisect_step(r, why)

def unverified(r: Runner, cands: list) -> Localization:
    mine = [c.flat for c in cands if c.rank == r.rank]
    total = r.pic.total_score
    shares = [float(r.view.scores[f]) / total if total > 0 else math.nan for f in mine]
    culprits, spans, samples = r.gather_records(mine, shares)
    if cands:
        why = "no probe closure given: shares are attribution scores" if r.solo else \
            "a rank gave no probe closure: shares are attribution scores"
        return r.record(method=Method.ATTRIBUTION, status=Status.UNVERIFIED, probes=0, culprits=culprits,
                           spans=spans, samples=samples, note=why)
    n = r.n_samples()
    note = "no token stands out in the attribution scores (no probe closure: nothing measured); " + \
        describe(samples, n)
    return r.record(method=Method.ATTRIBUTION, status=Status.DIFFUSE, probes=0, samples=samples, note=note)
