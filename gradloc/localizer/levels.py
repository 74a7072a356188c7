"""Below the tokens: which sample, span or micro-batch carries a spike no small token set explains.

Input: a :class:`~gradloc.localizer.decompose.Decomposition` of one micro-batch (each loss term's
exact share c_t of ‖∇‖², additive over any token set). Decision, in order (docs/DESIGN-NOTES.md,
"Levels"):

1. **sample** — the samples of the micro-batch by measured share Σ_{t∈b} c_t, best first; every
   outlier among them (≤ ``MAX_SAMPLES``: each carrying ≥ max(``MIN_SAMPLE_SHARE``, min(½,
   ``OUTLIER_FACTOR`` × its fair share 1/n)) of ‖∇‖² for n samples in the step, so a spike spread
   evenly over the samples never names the first half of them) is the culprit set when their union
   passes the verification test;
2. inside each culprit sample, **span** — the shortest contiguous window carrying ≥ ``SPAN_SHARE``
   of the sample's share; when it covers at most ``SPAN_COVER`` of the sample's loss tokens and its
   tokens carry ≥ ``SPAN_DENSITY`` × the share per token of the sample's other tokens, the level is
   ``span`` (``token`` for one token), else the whole sample's loss tokens are the span (``sample``);
3. **micro_batch** — no sample passes, but the micro-batch does, as an outlier among the
   micro-batches and by the gradient criteria (``micro_batch_passes``).

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
SPAN_DENSITY = 2.0
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


def outlier_floor(n: int) -> float:
    """The share of ‖∇‖² one of n samples must carry to be named: max(MIN_SAMPLE_SHARE, min(½, OUTLIER_FACTOR/n))."""
    return max(MIN_SAMPLE_SHARE, min(0.5, OUTLIER_FACTOR / max(n, 1)))


def pick_samples(measures: list[tuple[int, float, int]], passes, n_samples: int) -> SampleVerdict:  # noqa: ANN001
    """Every outlier among the top samples (≤ ``MAX_SAMPLES``), when their union passes the
    verification test ``passes(share)``; ``n_samples`` is the step's number of samples. All of them,
    not the smallest passing prefix: two copies of one bad sample each pass alone, and both are culprits."""
    floor = outlier_floor(n_samples)
    named = []
    for s, share, n_loss in measures[:MAX_SAMPLES]:
        if share < floor or n_loss == 0:
            break
        named.append((s, share))
    total = sum(share for _, share in named)
    if named and passes(total):
        return SampleVerdict(samples=tuple(measures), culprits=tuple(s for s, _ in named), explained=total)
    return SampleVerdict(samples=tuple(measures), culprits=(), explained=0.0)


def micro_batch_passes(share: float, n_micro_batches: int, passes) -> bool:  # noqa: ANN001
    """A micro-batch is named (level ``micro_batch``) only as an outlier among the step's micro-batches
    (≥ max(MIN_SAMPLE_SHARE, OUTLIER_FACTOR/M) of ‖∇‖² — never with M ≤ 2, where any micro-batch
    carries a fair half) and by the gradient test: a loss slightly above its healthy level would
    otherwise let any micro-batch of two pass on the loss criterion."""
    return share >= max(MIN_SAMPLE_SHARE, OUTLIER_FACTOR / max(n_micro_batches, 1)) and passes(share)


def regions_of(view: TokenView, m: int, sample: int, c: np.ndarray, share: float) -> tuple[Level, list[Region]]:
    """The span inside one culprit sample and the level it names (``span``/``token``/``sample``): the
    shortest contiguous window of the sample's loss tokens carrying ≥ ``SPAN_SHARE`` of its measured
    share (negative c counted as 0 in the search; the span's share is its raw Σ c), widened by the
    neighbours carrying at least half its share per token (the rest of a hot run). When that window
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
    if hi > lo:  # take in the run's edges: neighbours at ≥ half the window's share per token
        edge = 0.5 * float(ce[lo:hi].sum()) / (hi - lo)
        while lo > 0 and ce[lo - 1] >= edge:
            lo -= 1
        while hi < ce.size and ce[hi] >= edge:
            hi += 1
    inside = int(eligible[lo:hi].sum())
    if hi <= lo or inside > SPAN_COVER * loss_pos.size or not _concentrated(ce, lo, hi, inside, loss_pos.size):
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


def _concentrated(x: np.ndarray, lo: int, hi: int, inside: int, n_loss: int) -> bool:
    """The window's tokens carry ≥ ``SPAN_DENSITY`` × the share per token of the sample's other loss
    tokens (a uniformly bad sample: the 80% window covers ~80% of it, at the same density: not a span)."""
    outside = n_loss - inside
    if outside <= 0:
        return False
    per_in = float(x[lo:hi].sum()) / max(inside, 1)
    per_out = (float(x.sum()) - float(x[lo:hi].sum())) / outside
    return per_in >= SPAN_DENSITY * per_out


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
