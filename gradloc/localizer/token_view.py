"""Host-side view of one step's per-token scores (fetched only when a spike is localized)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gradloc.collector.batch import MicroBatchMeta
from gradloc.records import TokenRL


@dataclass(frozen=True)
class TokenView:
    layers: tuple[str, ...]
    metas: tuple[MicroBatchMeta, ...]
    offsets: tuple[int, ...]  # flat offset of each micro-batch (length M + 1)
    scores: np.ndarray  # (N,) Σ over layers, unscaled
    per_layer: np.ndarray | None  # (L, N); None without the per-layer breakdown
    eligible: np.ndarray  # (N,) bool: positions with a loss term
    unattributed_share: float
    exact_layer: int | None = None  # layer whose per-position score comes from that position's loss only
    exact_scores: np.ndarray | None = None  # (N,) that layer's scores (also without the breakdown)
    rl: dict[str, np.ndarray] | None = None  # (N,) per RL field (collector.rl_fields.FIELDS, "has"); NaN where not given

    @property
    def rank_scores(self) -> np.ndarray:
        """Scores to rank culprit candidates by: the exact layer's when known (an earlier layer also
        carries later tokens' gradients through attention, which would drag innocent context in)."""
        if self.exact_scores is not None:
            return self.exact_scores
        if self.exact_layer is not None and self.per_layer is not None:
            return self.per_layer[self.exact_layer]
        return self.scores

    def locate(self, flat: int) -> tuple[int, int, int]:
        """Flat index -> (micro-batch position in ``metas``, sample, position within the sample)."""
        m = int(np.searchsorted(self.offsets, flat, side="right")) - 1
        return (m, *self.metas[m].locate(flat - self.offsets[m]))

    def micro_batch_shares(self) -> tuple[float, ...]:
        total = float(self.scores.sum())
        if not np.isfinite(total) or total <= 0:
            return tuple(0.0 for _ in self.metas)
        return tuple(float(self.scores[a:b].sum()) / total for a, b in zip(self.offsets, self.offsets[1:]))

    def mask(self, m: int, flats: "np.ndarray | Sequence[int]" = ()) -> torch.Tensor:
        """(B, T) bool token mask of view position m selecting ``flats`` (flat indices inside micro-batch m; none:
        an all-false mask, a lockstep rank's empty part): the one place a probe's token mask is built."""
        meta = self.metas[m]
        mask = np.zeros(meta.n_tokens, dtype=bool)
        mask[np.asarray(flats, dtype=np.int64) - self.offsets[m]] = True
        return torch.from_numpy(mask.reshape(meta.batch, meta.seq))  # (B·T,) -> (B, T)

    def token_rl(self, flat: int) -> TokenRL | None:
        """One position's RL fields, with its sequence's mean mismatch log ratio (TokenRL.log_ratio)."""
        if self.rl is None or not self.rl["has"][flat]:
            return None
        r = self.rl

        def val(name: str) -> float | None:
            v = float(r[name][flat])
            return v if np.isfinite(v) else None

        m, sample, _ = self.locate(flat)
        a, b = self.metas[m].bounds(sample)
        base = self.offsets[m]
        seq = slice(base + a, base + b)
        trainer = np.where(np.isfinite(r["old_logp"][seq]), r["old_logp"][seq], r["logp"][seq])
        lr = (trainer - r["rollout_logp"][seq])[self.eligible[seq]]
        lr = lr[np.isfinite(lr)]
        return TokenRL(val("logp"), val("rollout_logp"), val("old_logp"), val("advantages"), val("ratio"),
                       bool(r["clipped"][flat]) if val("logp") is not None or r["clipped"].any() else None,
                       val("entropy"), float(lr.mean()) if lr.size else None)

    def sample_totals(self) -> list[tuple[int, int, float, int]]:
        """(micro-batch position, sample, Σ score over the sample's positions, loss tokens), best first."""
        out = []
        for m, meta in enumerate(self.metas):
            base = self.offsets[m]
            for s in range(meta.n_samples):
                a, b = meta.bounds(s)
                out.append((m, s, float(self.scores[base + a:base + b].sum()), int(self.eligible[base + a:base + b].sum())))
        return sorted(out, key=lambda r: -r[2] if np.isfinite(r[2]) else 0.0)

    def sample_flats(self, m: int, sample: int) -> np.ndarray:
        """Flat indices of the loss positions of one sample of micro-batch position m."""
        a, b = self.metas[m].bounds(sample)
        base = self.offsets[m]
        return np.flatnonzero(self.eligible[base + a:base + b]) + base + a
