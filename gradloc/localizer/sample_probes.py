"""Below the tokens without a decomposition (the exact layer is not one module, a scope whose stored gradient is
not whole on one rank — FSDP2, ZeRO — or a failed decomposition): each probe left measures one of the job's top
samples by attribution score; the passing ones are named (``sample`` level, no span inside them). In a job, a rank
whose samples could carry the spike together is measured as a whole (``ranks.py``). ``cx`` is ``below.py``'s
``BelowContext`` (the job's samples ``n``, the rank shapes ``ranks``)."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from gradloc.localizer import ranks
from gradloc.localizer.context import LocalizeResult
from gradloc.localizer.diffuse import TOP_SAMPLES
from gradloc.localizer.levels import SampleVerdict, pick_samples
from gradloc.localizer.runner import Runner
from gradloc.localizer.spans import range_span
from gradloc.localizer.trail import Trail, attributed, diffuse, record_samples
from gradloc.records import Level, Method, SampleShare, Status


def by_sample_probes(r: Runner, cx: Any, trail: Trail) -> LocalizeResult:
    """Each probe left measures one of the job's top samples; the passing ones are named (``sample`` level)."""
    every = r.comm.all_gather_object([(score, m, b, n, r.view.metas[m].index)
                                      for m, b, score, n in r.view.sample_totals()[:TOP_SAMPLES]], "gradloc samples")
    top = sorted(((score, rank, m, b, n, index) for rank, items in enumerate(every) for score, m, b, n, index in items),
                 key=lambda e: (-e[0] if math.isfinite(e[0]) else 0.0, e[1]))[:TOP_SAMPLES]
    measured: list[tuple[float, int, int, int, int, int]] = []  # (share, rank, view position, sample, tokens, index)
    for score, rank, m, b, n, index in top:
        if r.left <= 0:
            break
        if n == 0:
            continue
        group = (m, r.view.sample_flats(m, b)) if rank == r.rank else None
        start = len(r.session.losses)
        acc, err = r.probe_round([None] * len(r.stored.grads), group)
        share, _ = r.scope.measure(acc, float(sum(r.session.losses[start:])), err)
        del acc
        r.spend()
        measured.append((share, rank, m, b, n, index))
        if cx.ranks is not None and not _passing(r, cx, measured).culprits:
            trail = replace(trail, measured=_with_shares(r, measured))
            found, trail = ranks.after_sample_probe(r, cx.ranks, trail, rank, share)
            if found is not None:
                return found
    ranked = sorted(measured, key=lambda e: -e[0])
    passing = _passing(r, cx, ranked)
    trail = replace(trail, measured=_with_shares(r, measured))
    if not passing.culprits:
        return LocalizeResult(diffuse(r, cx.n, trail))
    mine = [ranked[i] for i in passing.culprits if ranked[i][1] == r.rank]
    spans = []
    for share, _, m, b, _, _ in mine:
        pos = r.view.sample_flats(m, b) - r.view.offsets[m] - r.view.metas[m].bounds(b)[0]
        span = range_span(r.view, m, b, int(pos[0]), int(pos[-1]) + 1, share, r.decode, r.cfg.context_tokens)
        spans.append(span if r.solo else replace(span, rank=r.rank))
    spans = sorted((x for e in r.comm.all_gather_object(spans, "gradloc culprit samples") for x in e),
                   key=lambda x: -x.share)
    trail = trail.note(f"{len(spans)} sample(s) measured by probes carry {passing.explained:.0%} of ‖∇‖² "
                       "(sample level; no decomposition, so no span inside them)")
    loc = r.record(method=Method.ATTRIBUTION, status=Status.LOCATED, level=Level.SAMPLE, probes=r.used,
                   spans=tuple(spans), samples=record_samples(r, trail), note=trail.text,
                   explained=passing.explained)
    return LocalizeResult(loc)


def _passing(r: Runner, cx: Any, measured: list[tuple]) -> SampleVerdict:
    """The sample verdict on probed samples (share, rank, view position, sample, tokens, index), best first."""
    return pick_samples([(i, e[0], e[4]) for i, e in enumerate(measured)], lambda x: r.verified(x), cx.n)


def _with_shares(r: Runner, measured: list[tuple]) -> tuple[SampleShare, ...]:
    """The job's top samples, with the probed ones' measured shares."""
    shares = {(e[1], e[5], e[3]): e[0] for e in measured}
    return tuple(replace(s, share=shares.get((s.rank or 0, s.micro_batch, s.sample), s.share)) for s in attributed(r))


__all__ = ["by_sample_probes"]
