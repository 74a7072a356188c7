"""levels.py's rules on hand-made decompositions: which samples, which span, when a micro-batch."""
from __future__ import annotations

import numpy as np

from gradloc.collector.batch import make_meta
from gradloc.localizer.levels import micro_batch_passes, outlier_floor, pick_samples, regions_of
from gradloc.localizer.token_view import TokenView
from gradloc.records import Level

B, T = 4, 20


def view() -> TokenView:
    n = B * T
    return TokenView((), (make_meta(0, None, None, None, (B, T)),), (0, n), np.ones(n), None, np.ones(n, bool), 0.0)


def test_a_uniformly_bad_sample_is_a_sample_not_its_80_percent_window() -> None:
    c = np.full(B * T, 0.001)
    c[T:2 * T] = 0.03 + 0.002 * np.sin(np.arange(T))  # sample 1: every token about as bad (uneven by ±7%)
    level, (region,) = regions_of(view(), 0, 1, c, float(c[T:2 * T].sum()))
    assert level == Level.SAMPLE and (region.start, region.end) == (0, T)


def test_a_concentrated_run_is_a_span() -> None:
    c = np.full(B * T, 0.001)
    c[T + 12:2 * T] = 0.05  # sample 1's tail, positions 12-19
    level, (region,) = regions_of(view(), 0, 1, c, float(c[T:2 * T].sum()))
    assert level == Level.SPAN and (region.start, region.end) == (12, T)


def test_every_outlier_sample_is_named_not_only_the_smallest_passing_set() -> None:
    """Two copies of one bad sample carry 35% each: either passes alone, both are the culprits."""
    measures = [(3, 0.35, T), (1, 0.35, T), (0, 0.05, T), (2, 0.04, T)]
    verdict = pick_samples(measures, lambda share: share >= 0.3, n_samples=16)
    assert verdict.culprits == (3, 1) and abs(verdict.explained - 0.7) < 1e-12
    assert pick_samples(measures, lambda share: share >= 0.9, n_samples=16).culprits == ()
    assert outlier_floor(16) == 2.5 / 16 and outlier_floor(2) == 0.5 and outlier_floor(100) == 0.1


def test_a_micro_batch_is_named_only_as_an_outlier_among_the_micro_batches() -> None:
    always = lambda share: True  # noqa: E731
    assert not micro_batch_passes(0.9, 2, always)  # one of two carries a fair half: never named
    assert not micro_batch_passes(0.3, 8, always) and micro_batch_passes(0.32, 8, always)
    assert not micro_batch_passes(0.6, 8, lambda share: share >= 0.7)  # and the gradient test holds


def _two_micro_batches(scores: np.ndarray) -> TokenView:
    n = B * T
    metas = (make_meta(0, None, None, None, (B, T)), make_meta(1, None, None, None, (B, T)))
    return TokenView((), metas, (0, n, 2 * n), scores, None, np.ones(2 * n, bool), 0.0)


def test_a_micro_batch_with_a_surprise_outlier_is_decomposed_first() -> None:
    """Attribution scores are sums of squares: a truncated document's coherent gradient can score
    below a healthy sample. The micro-batch holding the step's per-sample outlier goes first."""
    from types import SimpleNamespace

    from gradloc.localizer.below import BelowContext, micro_batch_order
    from gradloc.localizer.context import SpikeContext
    from gradloc.localizer.scope import SoloComm

    scores = np.ones(2 * B * T)
    scores[:T] = 5.0  # micro-batch 0's sample 0 scores highest
    order = {}
    for outliers in ((), ((1, 2),)):
        run = SimpleNamespace(view=_two_micro_batches(scores), comm=SoloComm(), solo=True,
                              ctx=SpikeContext(1.0, None, None, outliers=outliers))
        order[outliers] = list(micro_batch_order(run, BelowContext(n=2 * B, ranks=None)).order)
    assert order[()] == [(0, 0), (0, 1)]  # by the best sample's score
    assert order[((1, 2),)] == [(0, 1), (0, 0)]  # the outlier's micro-batch first
