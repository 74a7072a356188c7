"""The rank level: one rank of a job whose micro-batches together carry a spike that none of them,
and no sample of them, carries alone — a rank's data went wrong (a bad shard, a loader or tokenizer
that broke on one node).

``below.py`` tries it after a measurement on a rank found no sample or micro-batch culprit there,
and only when that rank could carry the spike: its attribution score share, or the measured share
extrapolated to its every micro-batch (a decomposed micro-batch's share × the rank's micro-batches,
a probed sample's × the rank's samples), reaches the rank floor. One probe then measures the rank's
every loss token, ⟨∇_r, ∇⟩ / ‖∇‖² (its micro-batches run one after the other on that rank, the
others idle or, in lockstep, take part with empty masks; the passes after the first are counted in
``Localization.passes``). A rank of one micro-batch just decomposed costs no probe: the
decomposition measured it exactly. A micro-batch that passes is checked the same way when the step
would still be a spike without it: the rank's other micro-batches may hold the same bad data, and
the rank, when it passes, is the complete answer.

The rank is named (level ``rank``) when its share reaches ``rank_floor(W)`` = max(0.1, min(0.75,
2.5 / W)) — an outlier among W ranks (with two ranks: three times the other's share) — and passes
the verification test (``context.verified``). Every rank takes the same path: the decisions come
from the gathered shapes and the scope's collective measure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from gradloc.localizer.context import LocalizeResult
from gradloc.localizer.levels import MIN_SAMPLE_SHARE, OUTLIER_FACTOR
from gradloc.localizer.probes import Grads
from gradloc.localizer.runner import Runner
from gradloc.localizer.trail import Trail, record_samples
from gradloc.records import CulpritGroup, Level, Method, Status

RANK_CAP = 0.75  # the floor never asks more of a rank than this share (W = 2, 3)
Found = tuple[LocalizeResult | None, Trail]  # a level's verdict (None: go on) and the trail after it


def rank_floor(world: int) -> float:
    """The share of ‖∇‖² one of W ranks must carry to be named: max(0.1, min(0.75, 2.5 / W))."""
    return max(MIN_SAMPLE_SHARE, min(RANK_CAP, OUTLIER_FACTOR / max(world, 1)))


@dataclass(frozen=True, kw_only=True)
class RankShape:
    """What one rank holds on the step: micro-batches, samples, loss tokens, Σ attribution score."""

    micro_batches: int
    samples: int
    tokens: int
    score: float


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """Every rank's shape on the step (gathered once), their total score and the rank floor."""

    shapes: tuple[RankShape, ...]
    total: float
    floor: float


def rank_context(r: Runner) -> RankContext:
    """Every rank's :class:`RankShape` (one collective: every rank calls it, W > 1)."""
    view = r.view
    score = float(np.where(view.eligible, np.nan_to_num(view.scores, nan=0.0, posinf=0.0), 0.0).sum())
    mine = RankShape(micro_batches=len(view.metas), samples=sum(m.n_samples for m in view.metas),
                     tokens=int(view.eligible.sum()), score=score)
    shapes = tuple(r.comm.all_gather_object(mine, "gradloc rank shapes"))
    return RankContext(shapes=shapes, total=sum(s.score for s in shapes), floor=rank_floor(len(shapes)))


def could_carry(rc: RankContext, trail: Trail, owner: int, extrapolated: float) -> bool:
    """Whether rank ``owner`` is worth a rank probe: not tried yet, and its score share or the extrapolated
    measured share reaches the floor."""
    score_share = rc.shapes[owner].score / rc.total if rc.total > 0 else 0.0
    return owner not in trail.tried and \
        max(score_share, extrapolated if math.isfinite(extrapolated) else 0.0) >= rc.floor


def after_decomposition(r: Runner, rc: RankContext, trail: Trail, owner: int, explained: float,
                        local: tuple | None) -> Found:
    """After one of rank ``owner``'s micro-batches was decomposed without a verdict (``local``: the
    decomposition's (c, gradient, loss) on the rank that ran it, else None)."""
    shape = rc.shapes[owner]
    if not could_carry(rc, trail, owner, explained * shape.micro_batches):
        return None, trail
    if shape.micro_batches == 1:  # the decomposition measured the rank's one micro-batch exactly
        trail = replace(trail, tried=trail.tried | {owner})
        mine = local[1] if local is not None else [None] * len(r.stored.grads)
        got, loss = r.scope.measure(mine, local[2] if local is not None else 0.0, "")
        return _judge(r, rc, trail, owner, got, loss, r.scope.norms(mine), mine)
    return probe_rank(r, rc, trail, owner)


def beyond_micro_batch(r: Runner, rc: RankContext, trail: Trail, owner: int, explained: float) -> Found:
    """A micro-batch of rank ``owner`` passed, but the step would still be a spike without it: the rank's
    other micro-batches may carry the rest (the same bad data on every one of them)."""
    shape = rc.shapes[owner]
    if shape.micro_batches < 2 or not could_carry(rc, trail, owner, explained * shape.micro_batches):
        return None, trail
    trail = trail.note(f"a micro-batch of rank {owner} carries {explained:.0%} of ‖∇‖², "
                       "and the step would still be a spike without it")
    return probe_rank(r, rc, trail, owner)


def after_sample_probe(r: Runner, rc: RankContext, trail: Trail, owner: int, share: float) -> Found:
    """After one sample of rank ``owner`` was probed without a verdict (no decomposition)."""
    if not could_carry(rc, trail, owner, share * rc.shapes[owner].samples):
        return None, trail
    return probe_rank(r, rc, trail, owner)


def probe_rank(r: Runner, rc: RankContext, trail: Trail, owner: int) -> Found:
    """One probe of rank ``owner``'s every loss token, judged."""
    if r.left <= 0:
        return None, trail
    trail = replace(trail, tried=trail.tried | {owner})
    k = rc.shapes[owner].micro_batches
    acc: Grads = [None] * len(r.stored.grads)
    error, start = "", len(r.session.losses)
    for i in range(k):  # the owner's micro-batches one after the other; the others idle or keep step
        group = None
        if owner == r.rank:
            a, e = r.view.offsets[i], r.view.offsets[i + 1]
            flats = np.flatnonzero(r.view.eligible[a:e]) + a
            group = (i, flats) if flats.size else None
        acc, err = r.probe_round(acc, group)
        error = error or err
    explained, loss = r.scope.measure(acc, float(sum(r.session.losses[start:])), error)
    r.spend()
    return _judge(r, rc, trail.passed(k - 1), owner, explained, loss, r.scope.norms(acc), acc)


def _judge(r: Runner, rc: RankContext, trail: Trail, owner: int, explained: float, loss: float,
           norms: tuple[float, float], grad: Grads) -> Found:
    shape = rc.shapes[owner]
    if not (math.isfinite(explained) and explained >= rc.floor and r.verified(explained, loss)):
        return None, trail.note(
            f"rank {owner}'s {shape.micro_batches} micro-batch(es) measured together: {explained:.0%} of ‖∇‖² "
            f"(a culprit rank carries ≥ {rc.floor:.0%} and passes verification)")
    trail = trail.note(f"rank {owner} carries {explained:.0%} of ‖∇‖² over its {shape.micro_batches} "
                       f"micro-batch(es) and {shape.samples} sample(s) (rank level)")
    group = CulpritGroup(share=explained, rank=owner, micro_batches=shape.micro_batches, samples=shape.samples,
                         tokens=shape.tokens)
    loc = r.record(method=Method.ATTRIBUTION, status=Status.LOCATED, level=Level.RANK, probes=r.used,
                   passes=trail.passes, samples=record_samples(r, trail), note=trail.text, explained=explained,
                   norms=norms, loss=loss, groups=(group,))
    return LocalizeResult(loc, grad if r.keep_grad else None), trail


__all__ = ["Found", "RankContext", "RankShape", "after_decomposition", "after_sample_probe", "beyond_micro_batch",
           "could_carry", "probe_rank", "rank_context", "rank_floor", "RANK_CAP"]
