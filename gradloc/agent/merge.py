"""Merge the per-rank views of one (job, step) into a :class:`CorrelatedIncident` (pure function)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from gradloc.records import Incident, TokenStats
from gradloc.reports import CorrelatedIncident, MicroBatchShare, RankShare, RankSpan, StepPoint


@dataclass(frozen=True)
class RankView:
    """What the correlator keeps of one rank's step record (not the layer columns)."""

    rank: int
    global_norm: float
    loss: float | None
    tokens: TokenStats | None
    norm_mean: float | None = None  # the detector's band the step was judged against (StepRecord)
    norm_threshold: float | None = None


def _rank_shares(views: Mapping[int, RankView]) -> dict[int, float]:
    """Each rank's part of the summed per-token attribution score (ranks without token stats: none)."""
    scores = {r: v.tokens.total_score for r, v in views.items()
              if v.tokens is not None and math.isfinite(v.tokens.total_score) and v.tokens.total_score >= 0}
    total = sum(scores.values())
    if total <= 0:
        return {r: 1.0 / len(scores) for r in scores} if scores else {}
    return {r: s / total for r, s in scores.items()}


def _micro_batches(views: Mapping[int, RankView], shares: Mapping[int, float]) -> tuple[MicroBatchShare, ...]:
    out = []
    for r in sorted(shares):
        tokens = views[r].tokens
        assert tokens is not None  # shares only has ranks with token stats
        out += [MicroBatchShare(r, m, shares[r] * s) for m, s in enumerate(tokens.micro_batch_shares)]
    return tuple(out)


def _spans(findings: Mapping[int, Incident], shares: Mapping[int, float]) -> tuple[RankSpan, ...]:
    out = []
    for r, inc in findings.items():
        if inc.localization is None:
            continue
        if inc.scope == "job":  # localized across the job's ranks: shares are global, each span names its rank
            out += [RankSpan(r if span.rank is None else span.rank, span.share, span) for span in inc.localization.spans]
            continue
        # A rank without token stats (or the only rank) keeps its rank-local share.
        scale = shares.get(r, 1.0 if len(findings) == 1 else math.nan)
        out += [RankSpan(r, span.share * scale, span) for span in inc.localization.spans]
    return tuple(sorted(out, key=lambda s: -s.share if math.isfinite(s.share) else math.inf))


def _rank_row(r: int, view: RankView | None, inc: Incident | None, share: float | None) -> RankShare:
    loc = inc.localization if inc is not None else None
    norm = view.global_norm if view is not None else (inc.spike.global_norm if inc is not None else None)
    loss = view.loss if view is not None else (inc.spike.loss if inc is not None else None)
    return RankShare(r, share, norm, loss, inc is not None, loc.status if loc else "", loc.probes if loc else 0)


def _ordered_union(groups: list[tuple[str, ...]]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for g in groups:
        seen.update(dict.fromkeys(g))
    return tuple(seen)


def _notes(expected: tuple[int, ...], views: Mapping[int, RankView], findings: Mapping[int, Incident],
           missing: tuple[int, ...]) -> list[str]:
    notes = []
    if missing:
        notes.append(f"rank(s) {', '.join(map(str, missing))} never reported this step before the deadline")
    late = sorted(set(findings) - set(views))
    if late:
        notes.append(f"rank(s) {', '.join(map(str, late))} sent a finding but no step record: no share")
    job_scope = sorted(r for r, f in findings.items() if f.scope == "job")
    if job_scope:
        notes.append(f"localized across the job's ranks by rank {job_scope[0]}: span shares are job-wide")
    no_tokens = sorted(r for r, v in views.items() if v.tokens is None)
    if no_tokens:
        notes.append(f"rank(s) {', '.join(map(str, no_tokens))} sent no token statistics: no share")
    return notes


def merge_incident(job: str, step: int, expected: tuple[int, ...], views: Mapping[int, RankView],
                   findings: Mapping[int, Incident], *, incident_id: str, trace_id: str,
                   closed_unix: float, note: str = "", world_size: int = 0,
                   history: tuple[StepPoint, ...] = ()) -> CorrelatedIncident:
    reported = tuple(sorted(set(views) | set(findings)))
    missing = tuple(r for r in expected if r not in reported)
    shares = _rank_shares(views)
    partial_view = [r for r in range(world_size) if r not in views]
    if partial_view and any(f.scope == "job" for f in findings.values()):
        shares = {}  # one rank's score is not its share of the job: no rank shares rather than a false 1.0
        note = "; ".join(n for n in (note, "rank shares need every rank's step records (a gradloc-agent daemon); "
                                     f"this agent did not hear rank(s) {', '.join(map(str, partial_view))}") if n)
    ranks = tuple(_rank_row(r, views.get(r), findings.get(r), shares.get(r)) for r in reported)
    ordered = [findings[r] for r in sorted(findings)]
    locs = [f.localization for f in ordered if f.localization is not None]
    explained = [x.explained_share for x in locs if x.explained_share is not None and math.isfinite(x.explained_share)]
    norms = [v.global_norm for v in views.values() if math.isfinite(v.global_norm)] or \
            [f.spike.global_norm for f in ordered]
    return CorrelatedIncident(
        incident_id=incident_id, trace_id=trace_id, job=job, step=step,
        time_unix=min(f.time_unix for f in ordered) if ordered else closed_unix,
        status="partial" if missing else "complete",
        kinds=_ordered_union([f.spike.kinds for f in ordered]),
        global_norm=max(norms) if norms else math.nan,
        ranks_expected=expected, ranks_reported=reported, ranks_missing=missing,
        rank_shares=ranks, micro_batch_shares=_micro_batches(views, shares),
        spans=_spans(findings, shares), findings=tuple(ordered), closed_unix=closed_unix,
        note="; ".join([n for n in [note] if n] + _notes(expected, views, findings, missing)),
        explained_share=max(explained) if explained else None,
        probes=sum(x.probes for x in locs),
        top_layers=_ordered_union([f.spike.layers for f in ordered]), history=history,
    )
