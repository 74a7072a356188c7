"""Naming only the tokens that carry the spike: a verified token set's weak candidates, measured.

A verified set C names every token it holds, with shares that are estimates: each first round's
measured share (one probe: one micro-batch per rank; a linear scope measures each round apart, an
inner product, no probe — otherwise C's first rounds together) split over its tokens by attribution
score. Two tokens of one micro-batch are one probe: a token the split credits with 9% of ‖∇‖² may
carry 0.1% (a healthy token beside a culprit, issue 32's persistent RL fault).

The rule, when a probe is left after C is verified (never beyond ``max_probes``):

1. D = the first-round candidates whose estimated share is below ``MIN_SAMPLE_SHARE`` (0.1: the
   share below which the sample level names no sample either, ``levels.py``). The tokens the growth
   rounds added are never in D: they were probed because the step would still be a spike without
   the others (the growth rounds, ``localizer.py``). D is tested only when C without it would, by the estimates,
   replace C: pass the verification test and, where C leaves no spike uncovered, leave none either
   (``context.rest_carries_spike``).
2. One probe measures D exactly, ⟨∇_D, ∇⟩/‖∇‖² and ℓ_D (each rank probes its members of D in one
   micro-batch, the one holding the most of its D's score; its members elsewhere stay in C).
3. D is not named — ∇_C − ∇_D kept (the norms, the remedy's gradient) — when it carries less than
   the floor and C without it, as measured (C's share and loss minus D's), still replaces C by step
   1's test. Otherwise D stays named, and the measurement is not lost: D's members share D's measured
   share and the rest of C gets C's minus D's (split by score within each part).

A token carrying 9.6% of ‖∇‖² is thus not named beside one carrying 68%: the sample level's bar,
measured rather than split. The probe's gradient is a second buffer beside ∇_C while it is measured
(as in the growth rounds of a non-linear scope), freed after. docs/DESIGN-NOTES.md, "Naming".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gradloc.localizer.context import by_micro_batch, rest_carries_spike
from gradloc.localizer.levels import MIN_SAMPLE_SHARE
from gradloc.localizer.probes import Grads

if TYPE_CHECKING:
    from gradloc.localizer.runner import Runner


@dataclass(frozen=True, kw_only=True)
class Measured:
    """A verified token set C as the token phase measured it."""

    acc: Grads  # ∇_C (the scope's form, as measured)
    explained: float  # ⟨∇_C, ∇⟩ / ‖∇‖²
    loss: float  # ℓ_C
    rounds: tuple[np.ndarray, ...]  # this rank's candidates probed in each first round (round i: index i)
    round_shares: list[float] | None  # the job's measured share of each first round (None: not measured apart)
    first: float  # the first rounds' measured share, together
    n_rounds: int  # first rounds (the job's)
    # (this rank's tokens, the job's measured share) of each round measured apart: the first rounds (one
    # part when not measured apart) and each growth round; what the record's shares are split from
    parts: tuple[tuple[np.ndarray, float], ...]


@dataclass(frozen=True, kw_only=True)
class Named:
    """The token set a verified localization names, after :func:`prune`."""

    acc: Grads
    explained: float
    loss: float
    note: str
    # (this rank's flats, the job's measured share of that part): each part's share is split by its
    # members' scores; one part when nothing was measured apart
    parts: tuple[tuple[np.ndarray, float], ...]


def estimates(run: "Runner", c: Measured) -> list[tuple[float, int, int]]:
    """(estimated share, rank, flat) of every first-round candidate of the job: its round's measured
    share split by score within the round (C's first-round share split over them all when the rounds
    were not measured apart)."""
    view, comm = run.view, run.comm
    n = c.n_rounds if c.round_shares is not None else 1
    rounds = list(c.rounds) + [np.zeros(0, dtype=np.int64)] * (c.n_rounds - len(c.rounds))
    if c.round_shares is None:
        rounds = [np.concatenate(rounds) if rounds else np.zeros(0, dtype=np.int64)]
    shares = c.round_shares if c.round_shares is not None else [c.first]
    local = torch.tensor([float(view.rank_scores[r].sum()) for r in rounds], dtype=torch.float64)  # (n,)
    totals = comm.all_reduce(local, what="gradloc prune scores").tolist() if n else []
    mine = [(share * float(w) / t if t > 0 else 0.0, int(f))
            for r, share, t in zip(rounds, shares, totals) for w, f in zip(view.rank_scores[r], r)]
    every = comm.all_gather_object(mine, "gradloc prune members")
    return sorted(((e, rank, f) for rank, items in enumerate(every) for e, f in items), key=lambda x: (x[0], x[1], x[2]))


def prune(run: "Runner", c: Measured, flats: np.ndarray) -> Named:
    """C (``flats``: this rank's members, first rounds and grown), with the candidates whose estimated
    share is below the floor measured and dropped when the module docstring's rule says so."""
    same = Named(acc=c.acc, explained=c.explained, loss=c.loss, note="", parts=c.parts)
    if run.left <= 0 or not math.isfinite(c.explained):
        return same
    comm, norm, ctx, view = run.comm, run.stored.norm, run.ctx, run.view
    members = estimates(run, c)
    weak = [(e, r, f) for e, r, f in members if e < MIN_SAMPLE_SHARE]
    if not weak:
        return same  # every candidate is estimated at the floor or above
    complete = not rest_carries_spike(c.explained, norm, ctx)  # C leaves no spike uncovered

    def enough(share: float, loss_k: float) -> bool:  # what K = C \ D must do to replace C
        return run.verified(share, loss_k) and not (complete and rest_carries_spike(share, norm, ctx))

    if not enough(c.explained - sum(e for e, _, _ in weak), 0.0):
        return same  # by the estimates, C without them would not be the answer
    drop = [f for _, r, f in weak if r == run.rank]
    group = None
    if drop:
        groups = by_micro_batch(view, drop)
        m = max(groups, key=lambda g: float(view.rank_scores[groups[g]].sum()))
        group = (m, groups[m])
    session = run.session
    start = len(session.losses)
    new, err = run.probe_round([None] * len(c.acc), group)
    run.spend()
    d, d_loss = run.scope.measure(new, float(sum(session.losses[start:])), err)
    n_drop = int(comm.all_reduce(torch.tensor([float(group[1].size if group else 0)], dtype=torch.float64),
                                 what="gradloc prune count")[0])
    kept, kept_loss = c.explained - d, c.loss - d_loss
    part = group[1] if group is not None else np.zeros(0, dtype=np.int64)
    rest = flats[~np.isin(flats, part)]
    if not (math.isfinite(d) and d < MIN_SAMPLE_SHARE and enough(kept, kept_loss)):
        del new
        return Named(acc=c.acc, explained=c.explained, loss=c.loss, parts=((rest, kept), (part, d)),
                     note=f"{n_drop} token(s) estimated below {MIN_SAMPLE_SHARE:.0%} of ‖∇‖² measured: {d:.1%}, named")
    acc = [a if n is None else (-n if a is None else a.sub_(n)) for a, n in zip(c.acc, new)]
    del new
    return Named(acc=acc, explained=kept, loss=kept_loss, parts=((rest, kept),),
                 note=f"{n_drop} token(s) estimated below {MIN_SAMPLE_SHARE:.0%} of ‖∇‖² measured: {d:.1%}, not named")


__all__ = ["Measured", "Named", "estimates", "prune"]
