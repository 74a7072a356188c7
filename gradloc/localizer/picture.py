"""The job's picture of a spike step: every rank's fixed-size summary, gathered in one collective.

Each rank attributes its own tokens (its hooks saw only its micro-batches). One ``all_gather`` of a
fixed-size row per rank — its top-K tokens by the position-exact score (with their micro-batch),
its median score, non-finite count, unattributed share, total score and flags — lets every rank
rank the job's candidates the same way (the core thresholds, with the median of the ranks'
medians) and know which are its own. With one rank this is ``candidates.select_candidates``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gradloc.collector.packs import Pack
from gradloc.localizer.token_view import TokenView
from gradloc.records import SampleShare

TOP_SAMPLES = 5


def row_layout(K: int) -> Pack:
    """A rank's row: its top-K tokens' scores, flat indices (-1: none) and micro-batch positions, its median score,
    non-finite count, unattributed share, total score, and whether it has a token view and a probe closure."""
    return Pack.of(scores=K, flats=K, micro_batches=K, median=1, nonfinite=1, unattributed=1, total=1, has_view=1,
                   has_probe=1)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    score: float
    rank: int
    flat: int  # flat index in that rank's view
    m: int  # micro-batch position in that rank's view


@dataclass(frozen=True, kw_only=True)
class Picture:
    rows: np.ndarray  # (W, len(row_layout(K)))
    K: int

    @property
    def world(self) -> int:
        return self.rows.shape[0]

    def _col(self, name: str) -> np.ndarray:
        return row_layout(self.K).get(self.rows, name)[:, 0]

    @property
    def all_have_view(self) -> bool:
        return bool(self._col("has_view").all())

    @property
    def all_have_probe(self) -> bool:
        return bool(self._col("has_probe").all())

    @property
    def nonfinite(self) -> bool:
        return bool(self._col("nonfinite").any())

    @property
    def max_unattributed(self) -> float:
        return float(self._col("unattributed").max())

    @property
    def total_score(self) -> float:
        return float(self._col("total").sum())

    @property
    def top_score(self) -> float:
        return float(row_layout(self.K).get(self.rows, "scores").max()) if self.rows.size and self.K else 0.0

    @property
    def median(self) -> float:
        return float(np.median(self._col("median")))

    def candidates(self, rel: float, outlier: float) -> list[Candidate]:
        """The job's candidates, best first (the same on every rank): score ≥ rel × the top score
        and ≥ outlier × the median score, at most K."""
        layout = row_layout(self.K)
        scores, flats, mbs = (layout.get(self.rows, f) for f in ("scores", "flats", "micro_batches"))  # (W, K) each
        entries = [Candidate(score=float(scores[r, j]), rank=r, flat=int(flats[r, j]), m=int(mbs[r, j]))
                   for r in range(self.world) for j in range(self.K) if flats[r, j] >= 0 and scores[r, j] > 0]
        if not entries:
            return []
        floor = max(rel * self.top_score, outlier * self.median)
        return sorted((e for e in entries if e.score >= floor), key=lambda e: (-e.score, e.rank, e.flat))[:self.K]


def summary(view: TokenView | None, K: int, has_probe: bool) -> torch.Tensor:
    """This rank's :func:`row_layout` row, float64."""
    layout = row_layout(K)
    out = torch.zeros(len(layout), dtype=torch.float64)
    layout.get(out, "flats")[:] = -1
    layout.get(out, "micro_batches")[:] = -1
    layout.get(out, "has_probe")[:] = float(has_probe)
    if view is None or view.scores.size == 0:
        return out
    s = np.where(view.eligible, view.rank_scores, 0.0)
    bad = view.eligible & ~(np.isfinite(view.scores) & np.isfinite(view.rank_scores))
    finite = np.where(np.isfinite(s), s, 0.0)
    order = np.argsort(-finite, kind="stable")[:K]
    n = order.size
    layout.get(out, "scores")[:n] = torch.from_numpy(finite[order])
    layout.get(out, "flats")[:n] = torch.from_numpy(order.astype(np.float64))
    layout.get(out, "micro_batches")[:n] = torch.tensor([float(view.locate(int(f))[0]) for f in order],
                                                        dtype=torch.float64)
    pool = finite[view.eligible]
    for name, value in (("median", float(np.median(pool)) if pool.size else 0.0), ("nonfinite", float(bad.sum())),
                        ("unattributed", view.unattributed_share), ("total", float(view.scores.sum())),
                        ("has_view", 1.0)):
        layout.get(out, name)[:] = value
    return out


def top_samples(view: TokenView) -> list[tuple[float, int, int, str | None, int]]:
    """(score, micro-batch index, sample, sample id, loss tokens) of this rank's top samples."""
    out = []
    for m, b, score, n_loss in view.sample_totals()[:TOP_SAMPLES]:
        meta = view.metas[m]
        out.append((score, meta.index, b, meta.sample_id(b), n_loss))
    return out


def merge_samples(every: list[list[tuple[float, int, int, str | None, int]]], total: float,
                  named_ranks: bool) -> tuple[SampleShare, ...]:
    """The job's top samples by attribution score (``rank`` set when the job has several ranks)."""
    total = total if total > 0 else math.nan
    merged = sorted(((s, r) for r, rank in enumerate(every) for s in rank), key=lambda e: -e[0][0])[:TOP_SAMPLES]
    return tuple(SampleShare(micro_batch=mb, sample=b, score_share=score / total, share=None, sample_id=sid,
                             tokens=n, rank=r if named_ranks else None) for (score, mb, b, sid, n), r in merged)
