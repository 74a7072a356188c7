"""ZClip-style running statistics: a warm-up of N samples, then EMA mean and variance.

Vectorised over K channels (the global norm is K=1, per-layer norms are K=L). A sample that is
itself a spike updates the EMA with its value clamped to μ + z_thr·σ, so one spike does not
inflate the statistics it is judged against. NaN entries (missing or non-finite) are skipped.
"""
from __future__ import annotations

import numpy as np


class EmaZ:
    def __init__(self, k: int, warmup: int, alpha: float, min_std_fraction: float) -> None:
        self.warmup, self.alpha, self.min_std_fraction = warmup, alpha, min_std_fraction
        self.mean = np.zeros(k)
        self.var = np.zeros(k)
        self._warm: list[np.ndarray] = []
        self.ready = np.zeros(k, dtype=bool)

    @property
    def std(self) -> np.ndarray:
        return np.maximum(np.sqrt(self.var), self.min_std_fraction * np.abs(self.mean) + 1e-12)

    def z(self, x: np.ndarray) -> np.ndarray:
        """z-scores of ``x`` against the current statistics (NaN where not ready or x missing)."""
        out = (np.asarray(x, dtype=float) - self.mean) / self.std
        out[~self.ready] = np.nan
        return out

    def update(self, x: np.ndarray, z_thr: float) -> None:
        x = np.asarray(x, dtype=float)
        finite = np.isfinite(x)
        if not self.ready.all():
            self._warm.append(np.where(finite, x, np.nan))
            if len(self._warm) >= self.warmup:
                warm = np.stack(self._warm)  # (warmup, K)
                counts = np.isfinite(warm).sum(0)
                with np.errstate(all="ignore"):
                    self.mean = np.where(counts > 1, np.nanmean(warm, 0), 0.0)
                    self.var = np.where(counts > 1, np.nanvar(warm, 0), 0.0)
                self.ready = counts > 1
                self._warm.clear()
            return
        clamped = np.minimum(x, self.mean + z_thr * self.std)
        upd = finite & self.ready
        a = self.alpha
        new_mean = a * self.mean + (1 - a) * clamped
        new_var = a * self.var + (1 - a) * (clamped - new_mean) ** 2
        self.mean = np.where(upd, new_mean, self.mean)
        self.var = np.where(upd, new_var, self.var)
