"""Below the tokens: which sample, span or micro-batch carries a spike no small token set explains.

Input: a :class:`~gradloc.localizer.decompose.Decomposition` of one micro-batch (each loss term's
exact share c_t of ‖∇‖², additive over any token set). Decision, in order (docs/DESIGN-NOTES.md,
"Levels"):

1. **sample** — the samples of the micro-batch by measured share Σ_{t∈b} c_t, best first; the
   smallest prefix of them (≤ ``MAX_SAMPLES``) whose union passes the verification test is the
   culprit set, each of them an outlier: carrying ≥ max(``MIN_SAMPLE_SHARE``, min(½,
   ``OUTLIER_FACTOR`` × its fair share 1/n)) of ‖∇‖² for n samples in the step (so a spike spread
   evenly over the samples never names the first half of them);
2. inside each culprit sample, **span** — the shortest contiguous window carrying ≥ ``SPAN_SHARE``
   of the sample's share; when it covers at most ``SPAN_COVER`` of the sample's loss tokens the level
   is ``span`` (``token`` for one token), else the whole sample's loss tokens are the span (``sample``);
3. **micro_batch** — no sample passes, but the micro-batch's measured share does.

Otherwise the spike is diffuse at this micro-batch, with every sample's measured share reported.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gradloc.localizer.token_view import TokenView
from gradloc.records import Level

MAX_SAMPLES = 3
MIN_SAMPLE_SHARE = 0.1
OUTLIER_FACTOR = 2.5
SPAN_SHARE = 0.8
SPAN_COVER = 0.8
TOP_TOKENS = 8  # culprit tokens listed per culprit sample (the largest c_t in its spans)


@dataclass(frozen=True, kw_only=True)
class Region:
    """A contiguous span [start, end) of sample ``sample`` of view position ``m``; ``share`` = Σ c / ‖∇‖²."""

    m: int
    sample: int
    start: int
    end: int
    share: float


@dataclass(frozen=True, kw_only=True)
class SampleVerdict:
    samples: tuple[tuple[int, float, int], ...]  # (sample, measured share, loss tokens), best first
    culprits: tuple[int, ...]  # the culprit samples (a prefix of ``samples``); empty: none passes
    explained: float  # Σ of the culprit samples' shares (0 without)


def sample_measures(view: TokenView, m: int, c: np.ndarray) -> list[tuple[int, float, int]]:
    """(sample, Σ c over its positions, loss tokens) of every sample of view position m, best first."""
    meta, base = view.metas[m], view.offsets[m]
    out = []
    for b in range(meta.n_samples):
        a, e = meta.bounds(b)
        out.append((b, float(c[a:e].sum()), int(view.eligible[base + a:base + e].sum())))
    return sorted(out, key=lambda r: -r[1])


def pick_samples(measures: list[tuple[int, float, int]], passes, n_samples: int) -> SampleVerdict:  # noqa: ANN001
    """The smallest verified union of the top samples; ``passes(share)`` is the verification test,
    ``n_samples`` the step's number of samples."""
    floor = max(MIN_SAMPLE_SHARE, min(0.5, OUTLIER_FACTOR / max(n_samples, 1)))
    total = 0.0
    for k, (_, share, n_loss) in enumerate(measures[:MAX_SAMPLES]):
        if share < floor or n_loss == 0:
            break
        total += share
        if passes(total):
            return SampleVerdict(samples=tuple(measures), culprits=tuple(s for s, _, _ in measures[:k + 1]),
                                 explained=total)
    return SampleVerdict(samples=tuple(measures), culprits=(), explained=0.0)


def regions_of(view: TokenView, m: int, sample: int, c: np.ndarray, share: float) -> tuple[Level, list[Region]]:
    """The span inside one culprit sample and the level it names (``span``/``token``/``sample``): the
    shortest contiguous window of the sample's loss tokens carrying ≥ ``SPAN_SHARE`` of its measured
    share (negative c counted as 0 in the search; the span's share is its raw Σ c). When that window
    covers more than ``SPAN_COVER`` of the sample's loss tokens, the whole sample is the culprit.
    Two separate hot regions come out as one window over both (or the sample): one span per sample."""
    a, e = view.metas[m].bounds(sample)
    base = view.offsets[m]
    eligible = view.eligible[base + a:base + e]
    loss_pos = np.flatnonzero(eligible)
    if loss_pos.size == 0:
        return Level.SAMPLE, []
    whole = Region(m=m, sample=sample, start=int(loss_pos[0]), end=int(loss_pos[-1]) + 1, share=share)
    ce = np.where(eligible, np.clip(c[a:e], 0.0, None), 0.0)  # (sample length,)
    lo, hi = _shortest_window(ce, SPAN_SHARE * share)
    if hi <= lo or int(eligible[lo:hi].sum()) > SPAN_COVER * loss_pos.size:
        return Level.SAMPLE, [whole]
    span = Region(m=m, sample=sample, start=lo, end=hi, share=float(c[a + lo:a + hi].sum()))
    return (Level.TOKEN if hi - lo == 1 else Level.SPAN), [span]


def top_tokens(view: TokenView, regions: list[Region], c: np.ndarray) -> list[int]:
    """Flat indices of the largest c_t inside the regions (≤ TOP_TOKENS per sample), for the culprit list."""
    out = []
    by_sample: dict[tuple[int, int], list[Region]] = {}
    for r in regions:
        by_sample.setdefault((r.m, r.sample), []).append(r)
    for (m, b), rs in by_sample.items():
        a, _ = view.metas[m].bounds(b)
        pos = np.concatenate([np.arange(r.start, r.end) for r in rs])  # positions within the sample
        best = pos[np.argsort(-c[a + pos], kind="stable")][:TOP_TOKENS]
        out += [view.offsets[m] + a + int(p) for p in best if c[a + p] > 0]
    return out


def _shortest_window(x: np.ndarray, target: float) -> tuple[int, int]:
    """[lo, hi) of the shortest window of ``x`` (≥ 0) with Σ ≥ ``target`` (ties: the larger Σ); (0, 0) when none."""
    if target <= 0 or x.size == 0:
        return 0, 0
    prefix = np.concatenate([[0.0], np.cumsum(x)])  # (n + 1,) non-decreasing
    ends = np.searchsorted(prefix, prefix[:-1] + target, side="left")  # first end with Σ[lo, end) ≥ target
    ok = ends <= x.size
    if not ok.any():
        return 0, 0
    lengths = np.where(ok, ends - np.arange(x.size), x.size + 1)
    best = np.flatnonzero(lengths == lengths.min())  # the shortest; among them the one carrying most
    sums = prefix[np.minimum(ends[best], x.size)] - prefix[best]
    lo = int(best[int(np.argmax(sums))])
    return lo, int(ends[lo])
