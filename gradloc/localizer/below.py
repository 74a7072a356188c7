"""When no small token set explains a spike: find the sample, span or micro-batch that does.

What is left of the ≤ ``max_probes`` budget goes, micro-batch by micro-batch (the job's micro-batch
holding the top-scoring sample first), to the decomposition probe (``decompose.py``) on the rank that
holds it: one probe and two forward-only passes measure every sample's and every token's exact share
of ‖∇‖² in that micro-batch. ``levels.py`` turns the shares into a verdict: a culprit sample (its
span when one carries it), else the micro-batch, else the next micro-batch. A probe left after a
verdict re-measures the culprit samples exactly (∇_S itself: ‖∇ − ∇_S‖, ℓ_S, and the gradient the
opt-in remedy drops).

Without a decomposition (the exact layer is not one module, a scope whose stored gradient is not
whole on one rank — FSDP2, ZeRO — or a failure), each remaining probe measures one top sample
instead, and a measured sample that passes is still named (``sample`` level; ``sample_probes.py``). In a job, a rank whose
micro-batches could carry the spike together is measured as a whole after a measurement on it found
nothing smaller (``ranks.py``: ``rank`` level). Nothing passes: ``diffuse``, with every measured
share reported. Every rank takes the same path: the owner's results
reach the others through ``all_gather_object``.

Each level is a function of the :class:`~gradloc.localizer.runner.Runner`, the frozen :class:`BelowContext` (the
job's samples, the micro-batch order, the rank shapes) and the :class:`~gradloc.localizer.trail.Trail` so far, to a
result and the next trail; :func:`below` drives them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from gradloc.localizer import ranks
from gradloc.localizer.context import LocalizeResult, out_of_band
from gradloc.localizer.decompose import decompose
from gradloc.localizer.diffuse import TOP_SAMPLES
from gradloc.localizer.levels import (
    SampleVerdict,
    micro_batch_passes,
    pick_samples,
    regions_of,
    sample_measures,
    top_tokens,
)
from gradloc.localizer.ranks import Found, RankContext
from gradloc.localizer.runner import Runner
from gradloc.localizer.sample_probes import by_sample_probes
from gradloc.localizer.spans import build_culprits, range_span
from gradloc.localizer.trail import Trail, diffuse, record_samples
from gradloc.records import CulpritGroup, Level, Method, SampleShare, Status

MAX_CLOSURE_ERROR = 0.25  # a decomposition whose Σ c_t misses the probe's ⟨∇_mb, ∇⟩ by more is not trusted


@dataclass(frozen=True, kw_only=True)
class BelowContext:
    n: int  # the job's samples on the step
    ranks: RankContext | None  # the rank level's shapes (W > 1)
    order: tuple[tuple[int, int], ...] = ()  # (rank, view position) to decompose, best first
    flagged: frozenset[tuple[int, int]] = frozenset()  # ... of those holding a per-sample surprise outlier
    m_total: int = 0  # the job's micro-batches


@dataclass(frozen=True, kw_only=True)
class Decomposition:
    """One micro-batch's decomposition as every rank learns it; ``local`` only on the rank that ran it."""

    error: str = ""
    closure_error: float = 0.0
    explained: float = 0.0  # the micro-batch's share of ‖∇‖², as the job sees it
    loss: float = 0.0
    measures: tuple = ()  # (sample, share, tokens, sample id, score share), best first
    index: int | None = None  # the micro-batch's index
    samples: int = 0
    tokens: int = 0
    local: tuple | None = None  # (c as the job sees it, the probe gradient, its loss) on the owner rank


@dataclass(frozen=True, kw_only=True)
class Part:
    """A micro-batch with culprit samples: where it is, the verdict, and its decomposition (owner rank only)."""

    owner: int
    m: int
    verdict: SampleVerdict
    index: int | None
    local: tuple | None


def below(r: Runner, why: str) -> LocalizeResult:
    """The levels below the tokens, in the runner's open probe session (module docstring)."""
    trail = Trail(notes=(why,))
    cx = BelowContext(n=r.n_samples(), ranks=None if r.solo else ranks.rank_context(r))
    if r.all_ranks(r.scope.decomposes and r.head is not None):
        cx = micro_batch_order(r, cx)
        pending: tuple[Part, ...] = ()
        for owner, m in cx.order:
            if r.left <= 0:
                break
            dec = decompose_at(r, owner, m)
            trail = trail.passed(2)
            if dec.error:
                trail = trail.note(f"decomposition unavailable ({dec.error})")
                break
            if dec.closure_error > MAX_CLOSURE_ERROR:
                trail = trail.note(f"decomposition of micro-batch {dec.index} off by {dec.closure_error:.0%} "
                                   "(not trusted)")
                continue
            found, trail, pending = verdict(r, cx, trail, pending, owner, m, dec)
            if found is None and cx.ranks is not None:
                found, trail = ranks.after_decomposition(r, cx.ranks, trail, owner, dec.explained, dec.local)
            if found is not None:
                return found
    if not trail.measured:
        return by_sample_probes(r, cx, trail)
    return LocalizeResult(diffuse(r, cx.n, trail))


# -- decomposition ------------------------------------------------------------------------------
def micro_batch_order(r: Runner, cx: BelowContext) -> BelowContext:
    """The job's micro-batches (rank, view position): those holding a per-sample surprise outlier of the step
    first (SpikeContext.outliers: the odd sample is known), then by their best sample's score, best first.
    Attribution scores are sums of squares: a coherent bad sample (a truncated document's predictable padding)
    can score below a healthy one."""
    view = r.view
    odd = {m for m, meta in enumerate(view.metas) for mb, _ in r.ctx.outliers if mb == meta.index}
    best: dict[int, float] = {}
    for m, _, score, _ in view.sample_totals():
        best.setdefault(m, score if math.isfinite(score) else 0.0)
    items = sorted((m, score, m in odd) for m, score in best.items())
    every = r.comm.all_gather_object(items, "gradloc micro-batch order")
    merged = [(not flagged, -score, rank, m) for rank, items in enumerate(every) for m, score, flagged in items]
    return replace(cx, order=tuple((rank, m) for _, _, rank, m in sorted(merged)), m_total=len(merged),
                   flagged=frozenset((rank, m) for odd, _, rank, m in merged if not odd))


def decompose_at(r: Runner, owner: int, m: int) -> Decomposition:
    """The decomposition probe of rank ``owner``'s micro-batch at view position ``m`` (one probe, every rank)."""
    payload, local = None, None
    if owner == r.rank:
        view, st = r.view, r.stored
        meta = view.metas[m]
        a, b = view.offsets[m], view.offsets[m + 1]
        mask = view.mask(m, np.flatnonzero(view.eligible[a:b]) + a)
        try:
            dec = decompose(r.session, meta.index, mask, st.grads, st.inv_scale, st.norm ** 2, r.head)
            k = r.scope.contribution  # DDP: a rank's own gradient enters the job's averaged
            c = dec.c * k
            local = (c, dec.grad, dec.loss)  # c as the job sees it; the gradient and loss as probed here
            measures = tuple((s, share, n, meta.sample_id(s), _score_share(r, m, s))
                             for s, share, n in sample_measures(view, m, c))
            payload = Decomposition(closure_error=dec.closure_error, explained=dec.explained * k, loss=dec.loss * k,
                                    measures=measures, index=meta.index, samples=meta.n_samples,
                                    tokens=int(view.eligible[a:b].sum()))
        except Exception as exc:  # noqa: BLE001 - an unusual model: fall back to sample probes
            payload = Decomposition(error=f"{type(exc).__name__}: {exc}")
    got = r.comm.all_gather_object(payload, "gradloc decomposition")[owner]
    r.spend()
    return replace(got, local=local if not got.error else None)


def _shares(r: Runner, dec: Decomposition, owner: int) -> tuple[SampleShare, ...]:
    rank = None if r.solo else owner
    return tuple(SampleShare(micro_batch=dec.index, sample=s, score_share=ss, share=share, sample_id=sid, tokens=n,
                             rank=rank) for s, share, n, sid, ss in dec.measures[:TOP_SAMPLES])


def _outliers(cx: BelowContext, dec: Decomposition) -> SampleVerdict:
    return pick_samples([(s, share, n) for s, share, n, _, _ in dec.measures], lambda x: True, cx.n)


def verdict(r: Runner, cx: BelowContext, trail: Trail, pending: tuple[Part, ...], owner: int, m: int,
            dec: Decomposition) -> tuple[LocalizeResult | None, Trail, tuple[Part, ...]]:
    """A decomposed micro-batch's verdict: its outlier samples (with those of micro-batches measured before: the
    copies of a duplicated bad sample) when their union passes verification, else the micro-batch itself."""
    trail = replace(trail, measured=(*trail.measured, *_shares(r, dec, owner)))
    odd = _outliers(cx, dec)
    if odd.culprits:
        pending = (*pending, Part(owner=owner, m=m, verdict=odd, index=dec.index, local=dec.local))
        if r.verified(sum(p.verdict.explained for p in pending)):
            more, trail = other_outliers(r, cx, trail, pending)
            return sample_level(r, cx, trail, (*pending, *more)), trail, pending
    found, trail = micro_batch_level(r, cx, trail, owner, dec)
    return found, trail, pending


def micro_batch_level(r: Runner, cx: BelowContext, trail: Trail, owner: int, dec: Decomposition) -> Found:
    """The decomposed micro-batch as the culprit when it passes (no sample of it does alone)."""
    if not micro_batch_passes(dec.explained, cx.m_total, lambda x: r.verified(x)):
        return None, trail.note(f"micro-batch {dec.index} measured: {dec.explained:.0%} of ‖∇‖², "
                                "no sample of it passes alone")
    mine = dec.local[1] if dec.local is not None else [None] * len(r.stored.grads)
    explained, loss = r.scope.measure(mine, dec.local[2] if dec.local is not None else 0.0, "")
    norms = r.scope.norms(mine)
    if cx.ranks is not None and out_of_band(norms[1], r.ctx):  # not the whole story: its rank?
        found, trail = ranks.beyond_micro_batch(r, cx.ranks, trail, owner, dec.explained)
        if found is not None:
            return found, trail
    trail = trail.note(f"micro-batch {dec.index} carries it; no sample of it alone does")
    group = CulpritGroup(share=explained, micro_batch=dec.index, rank=None if r.solo else owner,
                         samples=dec.samples, tokens=dec.tokens)
    loc = r.record(method=Method.ATTRIBUTION, status=Status.LOCATED, level=Level.MICRO_BATCH, probes=r.used,
                   passes=trail.passes, samples=record_samples(r, trail), note=trail.text,
                   explained=explained, norms=norms, loss=loss, groups=(group,))
    return LocalizeResult(loc, mine if r.keep_grad else None), trail


def other_outliers(r: Runner, cx: BelowContext, trail: Trail, pending: tuple[Part, ...]
                   ) -> tuple[tuple[Part, ...], Trail]:
    """The culprit samples of the other micro-batches holding a per-sample surprise outlier (the second copy of
    a duplicated bad sample), decomposed with the probes left. Their shares add exactly to the first
    micro-batch's; a sample is named when it is an outlier (``pick_samples``' floor), the union having passed
    already."""
    out: list[Part] = []
    done = {(p.owner, p.m) for p in pending}
    for o2, m2 in cx.order:
        if (o2, m2) in done or (o2, m2) not in cx.flagged or r.left <= 0:
            continue
        dec = decompose_at(r, o2, m2)
        trail = trail.passed(2)
        if dec.error or dec.closure_error > MAX_CLOSURE_ERROR:
            trail = trail.note(f"micro-batch {dec.index if dec.index is not None else '?'} with an odd sample: "
                               "no usable decomposition")
            continue
        trail = replace(trail, measured=(*trail.measured, *_shares(r, dec, o2)))
        odd = _outliers(cx, dec)
        if odd.culprits:
            out.append(Part(owner=o2, m=m2, verdict=odd, index=dec.index, local=dec.local))
    return tuple(out), trail


def sample_level(r: Runner, cx: BelowContext, trail: Trail, parts: tuple[Part, ...]) -> LocalizeResult:
    """The culprit samples of ``parts`` (their spans, when one carries a sample), re-measured by a probe when
    they are in one micro-batch and one is left."""
    first, more = parts[0], parts[1:]
    explained, norms, loss, grad = sum(p.verdict.explained for p in parts), (None, None), None, None
    # culprits in several micro-batches: their decomposed shares add up (one probe round covers one
    # micro-batch per rank, so they are not re-measured together)
    if not more and r.left > 0:  # measure the culprit samples themselves
        group = None
        if first.owner == r.rank:
            group = (first.m, np.concatenate([r.view.sample_flats(first.m, b) for b in first.verdict.culprits]))
        start = len(r.session.losses)
        acc, err = r.probe_round([None] * len(r.stored.grads), group)
        exact, loss = r.scope.measure(acc, float(sum(r.session.losses[start:])), err)
        norms = r.scope.norms(acc)
        r.spend()
        trail = trail.note(f"the decomposition gave {explained:.0%}, a probe of the sample(s) {exact:.0%}")
        explained, grad = exact, (acc if r.keep_grad else None)
    levels, culprits, spans = set(), [], []
    for p in parts:
        lv, cs, ss = r.comm.all_gather_object(regions(r, p) if p.owner == r.rank else None,
                                              "gradloc culprit samples")[p.owner]
        levels.add(lv)
        culprits += cs
        spans += ss
    level = levels.pop() if len(levels) == 1 else Level.SPAN
    if more:  # one list over the micro-batches, largest share first
        culprits, spans = sorted(culprits, key=lambda x: -x.share), sorted(spans, key=lambda x: -x.share)
    what = "; ".join(", ".join(f"sample {b}" for b in p.verdict.culprits) + f" of micro-batch {p.index}" for p in parts)
    n_named = sum(len(p.verdict.culprits) for p in parts)
    trail = trail.note(f"{what} carr{'ies' if n_named == 1 else 'y'} {explained:.0%} of ‖∇‖² ({level.value} level)")
    loc = r.record(method=Method.ATTRIBUTION, status=Status.LOCATED, level=level, probes=r.used,
                   passes=trail.passes, culprits=tuple(culprits), spans=tuple(spans), samples=record_samples(r, trail),
                   note=trail.text, explained=explained, norms=norms, loss=loss)
    return LocalizeResult(loc, grad)


def regions(r: Runner, part: Part) -> tuple:
    """(level, culprits, spans) of a part's culprit samples, on the rank that holds them."""
    c, m, v = part.local[0], part.m, part.verdict
    share_of = {b: s for b, s, _ in v.samples}
    levels, found = [], []
    for b in v.culprits:
        level, rs = regions_of(r.view, m, b, c, share_of[b])
        levels.append(level)
        found += rs
    level = levels[0] if len(set(levels)) == 1 else Level.SPAN
    flats = top_tokens(r.view, found, c)
    base = r.view.offsets[m]
    culprits = build_culprits(r.view, flats, [float(c[f - base]) for f in flats], r.decode)
    spans = tuple(range_span(r.view, x.m, x.sample, x.start, x.end, x.share, r.decode, r.cfg.context_tokens)
                  for x in found)
    if not r.solo:
        culprits = tuple(replace(x, rank=r.rank) for x in culprits)
        spans = tuple(replace(x, rank=r.rank) for x in spans)
    return level, culprits, spans


def _score_share(r: Runner, m: int, b: int) -> float:
    total = r.pic.total_score
    a, e = r.view.metas[m].bounds(b)
    base = r.view.offsets[m]
    return float(r.view.scores[base + a:base + e].sum()) / total if math.isfinite(total) and total > 0 else math.nan


__all__ = ["BelowContext", "Decomposition", "Part", "below", "decompose_at", "micro_batch_level", "micro_batch_order",
           "other_outliers", "regions", "sample_level", "verdict"]
