"""Culprit candidates from one-pass attribution scores."""
from __future__ import annotations

import numpy as np

from gradloc.config import LocalizerConfig


def select_candidates(scores: np.ndarray, eligible: np.ndarray, cfg: LocalizerConfig) -> np.ndarray:
    """Flat indices of outlier tokens, best first.

    A token qualifies if its score is at least ``candidate_rel_score`` × the top score *and*
    ``candidate_outlier_factor`` × the median eligible score (a spike's culprits stand far above the
    typical token); at most ``max_candidates``. Non-finite scores come first: a NaN/Inf gradient
    is located at the positions where it appears.
    """
    s = np.where(eligible, scores, 0.0)
    bad = np.flatnonzero(eligible & ~np.isfinite(scores))
    if bad.size:
        return bad[: cfg.max_candidates]
    order = np.argsort(-s, kind="stable")
    top = s[order[0]] if s.size else 0.0
    if top <= 0:
        return np.zeros(0, dtype=np.int64)
    pool = s[eligible]
    median = float(np.median(pool)) if pool.size else 0.0
    floor = max(cfg.candidate_rel_score * top, cfg.candidate_outlier_factor * median)
    keep = order[s[order] >= floor]
    return keep[: cfg.max_candidates]
