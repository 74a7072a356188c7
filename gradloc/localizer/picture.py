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

from gradloc.localizer.token_view import TokenView
from gradloc.records import SampleShare

TOP_SAMPLES = 5
HAS_VIEW, HAS_PROBE = 1.0, 2.0  # flag bits of a row's last field


@dataclass(frozen=True, kw_only=True)
class Candidate:
    score: float
    rank: int
    flat: int  # flat index in that rank's view
    m: int  # micro-batch position in that rank's view


@dataclass(frozen=True, kw_only=True)
class Picture:
    rows: np.ndarray  # (W, 3K + 5)
    K: int

    @property
    def world(self) -> int:
        return self.rows.shape[0]

    def _col(self, i: int) -> np.ndarray:
        return self.rows[:, 3 * self.K + i]

    @property
    def all_have_view(self) -> bool:
        return bool((self._col(4) % 2).all())

    @property
    def all_have_probe(self) -> bool:
        return bool((self._col(4) >= HAS_PROBE).all())

    @property
    def nonfinite(self) -> bool:
        return bool(self._col(1).any())

    @property
    def max_unattributed(self) -> float:
        return float(self._col(2).max())

    @property
    def total_score(self) -> float:
        return float(self._col(3).sum())

    @property
    def top_score(self) -> float:
        return float(self.rows[:, 0].max()) if self.rows.size else 0.0

    @property
    def median(self) -> float:
        return float(np.median(self._col(0)))

    def candidates(self, rel: float, outlier: float) -> list[Candidate]:
        """The job's candidates, best first (the same on every rank): score ≥ rel × the top score
        and ≥ outlier × the median score, at most K."""
        K, rows = self.K, self.rows
        entries = [Candidate(score=float(rows[r, j]), rank=r, flat=int(rows[r, K + j]), m=int(rows[r, 2 * K + j]))
                   for r in range(rows.shape[0]) for j in range(K) if rows[r, K + j] >= 0 and rows[r, j] > 0]
        if not entries:
            return []
        floor = max(rel * self.top_score, outlier * self.median)
        return sorted((e for e in entries if e.score >= floor), key=lambda e: (-e.score, e.rank, e.flat))[:K]


def summary(view: TokenView | None, K: int, has_probe: bool) -> torch.Tensor:
    """[top-K scores | their flats | their micro-batch positions | median | non-finite | unattributed |
    total | flags], float64 (3K + 5,)."""
    out = torch.zeros(3 * K + 5, dtype=torch.float64)
    out[K:3 * K] = -1
    out[-1] = HAS_PROBE if has_probe else 0.0
    if view is None or view.scores.size == 0:
        return out
    s = np.where(view.eligible, view.rank_scores, 0.0)
    bad = view.eligible & ~(np.isfinite(view.scores) & np.isfinite(view.rank_scores))
    finite = np.where(np.isfinite(s), s, 0.0)
    order = np.argsort(-finite, kind="stable")[:K]
    n = order.size
    out[:n] = torch.from_numpy(finite[order])
    out[K:K + n] = torch.from_numpy(order.astype(np.float64))
    out[2 * K:2 * K + n] = torch.tensor([float(view.locate(int(f))[0]) for f in order], dtype=torch.float64)
    pool = finite[view.eligible]
    out[3 * K] = float(np.median(pool)) if pool.size else 0.0
    out[3 * K + 1:3 * K + 4] = torch.tensor([float(bad.sum()), view.unattributed_share, float(view.scores.sum())])
    out[-1] += HAS_VIEW
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
