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
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gradloc.localizer.context import LocalizeResult
from gradloc.localizer.levels import MIN_SAMPLE_SHARE, OUTLIER_FACTOR
from gradloc.localizer.runner import Runner
from gradloc.records import CulpritGroup, Level, Method, Status

RANK_CAP = 0.75  # the floor never asks more of a rank than this share (W = 2, 3)


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


class Finder(Protocol):
    """What the rank level adds to, of the level that tries it (``below.Below``): its notes and passes so far, and
    the job's top samples for the record."""

    notes: list[str]
    passes: int

    def samples(self) -> tuple: ...


class Ranks:
    """The rank level of one localization (``below.Below`` holds one when the job has W > 1 ranks)."""

    def __init__(self, run: Runner, level: Finder) -> None:
        self.r, self.b = run, level
        r = run
        view = r.view
        score = float(np.where(view.eligible, np.nan_to_num(view.scores, nan=0.0, posinf=0.0), 0.0).sum())
        mine = RankShape(micro_batches=len(view.metas), samples=sum(m.n_samples for m in view.metas),
                         tokens=int(view.eligible.sum()), score=score)
        self.shapes: list[RankShape] = r.comm.all_gather_object(mine, "gradloc rank shapes")
        self.total = sum(s.score for s in self.shapes)
        self.floor = rank_floor(len(self.shapes))
        self.tried: set[int] = set()

    def could_carry(self, owner: int, extrapolated: float) -> bool:
        """Whether rank ``owner`` is worth a rank probe: not tried yet, a probe left (or none needed),
        and its score share or the extrapolated measured share reaches the floor."""
        score_share = self.shapes[owner].score / self.total if self.total > 0 else 0.0
        if owner in self.tried or max(score_share, extrapolated if math.isfinite(extrapolated) else 0.0) < self.floor:
            return False
        return True

    def after_decomposition(self, owner: int, explained: float, dec: Any) -> LocalizeResult | None:
        """After one of rank ``owner``'s micro-batches was decomposed without a verdict (``dec``: the decomposition's
        (c, gradient, loss) on the rank that ran it, else None)."""
        shape = self.shapes[owner]
        if not self.could_carry(owner, explained * shape.micro_batches):
            return None
        if shape.micro_batches == 1:  # the decomposition measured the rank's one micro-batch exactly
            self.tried.add(owner)
            r = self.r
            mine = dec[1] if dec is not None else [None] * len(r.stored.grads)
            got, loss = r.scope.measure(mine, dec[2] if dec is not None else 0.0, "")
            return self._judge(owner, got, loss, r.scope.norms(mine), mine)
        return self.probe(owner)

    def beyond_micro_batch(self, owner: int, explained: float) -> LocalizeResult | None:
        """A micro-batch of rank ``owner`` passed, but the step would still be a spike without it: the
        rank's other micro-batches may carry the rest (the same bad data on every one of them)."""
        shape = self.shapes[owner]
        if shape.micro_batches < 2 or not self.could_carry(owner, explained * shape.micro_batches):
            return None
        self.b.notes.append(f"a micro-batch of rank {owner} carries {explained:.0%} of ‖∇‖², "
                            "and the step would still be a spike without it")
        return self.probe(owner)

    def after_sample_probe(self, owner: int, share: float) -> LocalizeResult | None:
        """After one sample of rank ``owner`` was probed without a verdict (no decomposition)."""
        return self.probe(owner) if self.could_carry(owner, share * self.shapes[owner].samples) else None

    def probe(self, owner: int) -> LocalizeResult | None:
        """One probe of rank ``owner``'s every loss token, judged."""
        r = self.r
        if r.left <= 0:
            return None
        self.tried.add(owner)
        k = self.shapes[owner].micro_batches
        acc, error, start = [None] * len(r.stored.grads), "", len(r.session.losses)
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
        self.b.passes += k - 1
        return self._judge(owner, explained, loss, r.scope.norms(acc), acc)

    def _judge(self, owner: int, explained: float, loss: float, norms: tuple[float, float], grad) -> LocalizeResult | None:  # noqa: ANN001
        b, r, shape = self.b, self.r, self.shapes[owner]
        if not (math.isfinite(explained) and explained >= self.floor and r.verified(explained, loss)):
            b.notes.append(f"rank {owner}'s {shape.micro_batches} micro-batch(es) measured together: "
                           f"{explained:.0%} of ‖∇‖² (a culprit rank carries ≥ {self.floor:.0%} and passes verification)")
            return None
        b.notes.append(f"rank {owner} carries {explained:.0%} of ‖∇‖² over its {shape.micro_batches} micro-batch(es) "
                       f"and {shape.samples} sample(s) (rank level)")
        group = CulpritGroup(share=explained, rank=owner, micro_batches=shape.micro_batches, samples=shape.samples,
                             tokens=shape.tokens)
        loc = r.record(method=Method.ATTRIBUTION, status=Status.LOCATED, level=Level.RANK, probes=r.used,
                       passes=b.passes, samples=b.samples(), note="; ".join(b.notes), explained=explained,
                       norms=norms, loss=loss, groups=(group,))
        return LocalizeResult(loc, grad if r.keep_grad else None)


__all__ = ["Finder", "RankShape", "Ranks", "rank_floor", "RANK_CAP"]
