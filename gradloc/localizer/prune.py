"""Naming only the tokens that carry the spike: a verified token set's weak members, measured.

A verified set C names every token it holds, and the share each one is reported with is C's measured
⟨∇_C, ∇⟩/‖∇‖² split by the tokens' attribution scores — an estimate, not a measurement. Two members
of one micro-batch are one probe: a token the scores credit with 9% of ‖∇‖² may carry 0.1% (a
healthy token beside a culprit), and a micro-batch probed for its runner-up candidate may carry a
real but minor share beside the micro-batch that holds the spike.

The rule, when a probe is left after C is verified (never beyond ``max_probes``):

1. K = the smallest set of C's best-scoring tokens (job-wide) whose *estimated* share alone would
   pass the verification test; the rest, D, are the tokens the estimate calls unnecessary. When K is
   all of C, nothing is tested.
2. One probe measures D exactly, ⟨∇_D, ∇⟩/‖∇‖² and ℓ_D (each rank probes its members of D in one
   micro-batch, the one holding the most of its D's score; D's members elsewhere stay named).
3. D is dropped — K named, ∇_K = ∇_C − ∇_D kept — when D carries less than ``MIN_SAMPLE_SHARE``
   (0.1, the share below which the sample level names no sample either: ``levels.py``), K still
   passes the verification test, and dropping D does not leave the spike uncovered where C did not
   (``context.rest_carries_spike``). Otherwise C stays named; the probe is spent.

A member carrying 9.6% of ‖∇‖² is thus not named beside one carrying 68%: the same bar as for a
sample. The probe's gradient is a second buffer beside ∇_C while it is measured (as in the growth
rounds of a non-linear scope), freed after.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from gradloc.localizer.context import by_micro_batch, rest_carries_spike
from gradloc.localizer.levels import MIN_SAMPLE_SHARE
from gradloc.localizer.probes import Grads

if TYPE_CHECKING:
    from gradloc.localizer.localizer import _Run


def prune(run: "_Run", acc: Grads, explained: float, loss: float, flats: np.ndarray,
          used: int) -> tuple[Grads, float, float, np.ndarray, int, str]:
    """(∇ of the named set, its explained share, its loss, this rank's named flats, probes used, note)."""
    same = (acc, explained, loss, flats, used, "")
    if used >= run.cfg.max_probes or not math.isfinite(explained):
        return same
    view, comm, norm, ctx = run.view, run.comm, run.stored.norm, run.ctx
    w = view.rank_scores[flats]  # (n,) this rank's members' scores
    every = comm.all_gather_object([(float(s), int(f)) for s, f in zip(w, flats)], "gradloc prune members")
    members = sorted(((s, r, f) for r, items in enumerate(every) for s, f in items), key=lambda e: (-e[0], e[1], e[2]))
    total = sum(s for s, _, _ in members)
    if len(members) < 2 or not total > 0:
        return same
    cum, k = 0.0, len(members)
    for i, (s, _, _) in enumerate(members):
        cum += s
        if run.loc._verified(explained * cum / total, norm, 0.0, ctx):
            k = i + 1
            break
    if k == len(members):
        return same
    drop = [f for _, r, f in members[k:] if r == run.rank]
    group = None
    if drop:
        groups = by_micro_batch(view, drop)
        m = max(groups, key=lambda g: float(view.rank_scores[groups[g]].sum()))
        group = (m, groups[m])
    session = run.session
    start = len(session.losses)
    new, err = run.probe_round([None] * len(acc), group)
    d, d_loss = run.scope.measure(new, float(sum(session.losses[start:])), err)
    used += 1
    n_drop = int(comm.all_reduce(torch.tensor([float(group[1].size if group else 0)], dtype=torch.float64),
                                 what="gradloc prune count")[0])
    kept, kept_loss = explained - d, loss - d_loss
    ok = (math.isfinite(d) and d < MIN_SAMPLE_SHARE and run.loc._verified(kept, norm, kept_loss, ctx)
          and (rest_carries_spike(explained, norm, ctx) or not rest_carries_spike(kept, norm, ctx)))
    what = f"{n_drop} "
    if not ok:
        del new
        return acc, explained, loss, flats, used, (f"the {what}weakest-scored token(s) measured: {d:.1%} of ‖∇‖², "
                                                   "kept")
    acc = [a if n is None else (-n if a is None else a.sub_(n)) for a, n in zip(acc, new)]
    del new
    if group is not None:
        flats = flats[~np.isin(flats, group[1])]
    return acc, kept, kept_loss, flats, used, (f"the {what}weakest-scored token(s) measured: {d:.1%} of ‖∇‖² "
                                               f"(< {MIN_SAMPLE_SHARE:.0%}), not named")


__all__ = ["prune"]
