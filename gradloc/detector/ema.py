"""Running statistics a z-score is judged against, robust to early spikes and trend-aware.

Vectorised over K channels (the global norm is K=1, per-layer norms are K=L). NaN entries (missing
or non-finite) are skipped. Two phases:

- **Warm-up** (the first ``warmup`` samples; a channel with fewer than 3 finite ones among them
  warms up again over the next ``warmup``, the others going on): nothing is judged. At its end the
  statistics are *robust* estimates, so a real early spike or the steep fall of early training
  does not inflate them: the level is the median of the warm-up's last quarter (at least 3
  samples: the level the run has reached, not the warm-up's average), σ is 1.4826 × the median
  absolute deviation of the successive differences / √2 (the step-to-step spread; a trend adds
  nothing to it, one spike moves a median by one rank). ZClip's plain mean and variance over the
  warm-up took the early spikes and the fall from initialisation into σ, and an EMA at α 0.97
  halves σ only every ~46 steps (issue 32: σ 0.60 at step 250 where the healthy spread was
  0.09). :meth:`warm_level` is the median of the last quarter so far, for judging a step
  inside the warm-up (the detector's ``warmup_spike``).
- **After the warm-up**: an EMA level (``mean``, ``alpha``) whose σ is the spread of the residuals
  *around the trend*, not around the lagging mean. On a trending norm the residual x − mean carries
  the EMA's lag (32 steps' change at α 0.97), and ZClip's σ² took that lag in. Here ``lag`` is a
  fast EMA of the residuals (``LAG_GAIN`` × the level's rate: ~8 steps), and σ² is the EMA of
  (residual − lag)². Each residual is clamped to lag ± ``z_thr``·σ before it updates anything, so
  one outlier, up or down, moves the level, the lag and σ only a bounded amount (σ² by at most
  ×(1 + (1 − α)(z_thr² − 1)), 16 % at the defaults). The clamp is centred on the lag, so a steep
  trend does not leave the level behind; a persistent level shift keeps its residuals at the clamp
  and widens σ until the level has caught up. ``mean`` itself stays the lagging EMA: a forecast
  that extrapolates the trend went to ~0 on the demo's norm (falling 200× in 100 steps) and made
  every step a multiple of it. So z = (x − mean)/σ still carries the lag: on a falling norm it
  reads low, on a rising one high (the ratio lines of the detector's rules keep the latter from
  opening incidents on their own).

:class:`ZClipEma` is ZClip's own statistics, step for step (a plain mean and variance over the
warm-up, then an EMA mean and variance with the sample clamped to μ + z_thr·σ): the detector uses it
at ``sensitivity="zclip"``, the rule gradloc had before.
"""
from __future__ import annotations

import numpy as np

LAG_GAIN = 4.0  # the lag's EMA rate, × the level's (1 − alpha)
_MAD_SIGMA = 1.4826  # σ of a normal distribution per unit median absolute deviation
_MIN_LEVEL_SAMPLES = 3


def _tail(n: int) -> int:
    """How many of the last warm-up samples make its level: a quarter, at least 3."""
    return max(_MIN_LEVEL_SAMPLES, n // 4)


class EmaZ:
    def __init__(self, k: int, warmup: int, alpha: float, min_std_fraction: float) -> None:
        self.warmup, self.alpha, self.min_std_fraction = warmup, alpha, min_std_fraction
        self.level = np.zeros(k)
        self.lag = np.zeros(k)  # running mean of the residuals x − level: the level's lag behind a trend
        self.var = np.zeros(k)
        self._warm: list[np.ndarray] = []
        self.ready = np.zeros(k, dtype=bool)

    @property
    def mean(self) -> np.ndarray:
        """The level: an EMA of the clamped samples."""
        return self.level

    @property
    def std(self) -> np.ndarray:
        return np.maximum(np.sqrt(self.var), self.min_std_fraction * np.abs(self.mean) + 1e-12)

    def z(self, x: np.ndarray) -> np.ndarray:
        """z-scores of ``x`` against the current statistics (NaN where not ready or x missing)."""
        out = (np.asarray(x, dtype=float) - self.mean) / self.std
        out[~self.ready] = np.nan
        return out

    def warm_level(self) -> np.ndarray:
        """During the warm-up, the median of its last quarter so far (NaN where fewer than 3 finite
        samples, or ready)."""
        out = np.full(self.level.shape, np.nan)
        if not self._warm:
            return out
        recent = np.stack(self._warm)  # (n, K)
        counts = np.isfinite(recent).sum(0)
        n = _tail(int(counts.max()))
        with np.errstate(all="ignore"):
            tail = np.stack([_last_finite(recent[:, i], n) for i in range(recent.shape[1])], 1)  # (n, K)
            med = np.nanmedian(tail, 0) if tail.size else out
        return np.where((counts >= _MIN_LEVEL_SAMPLES) & ~self.ready, med, np.nan)

    def update(self, x: np.ndarray, z_thr: float) -> None:
        x = np.asarray(x, dtype=float)
        finite = np.isfinite(x)
        upd = finite & self.ready  # channels still warming up (never seen enough samples) wait below
        if not self.ready.all():
            self._warm.append(np.where(finite, x, np.nan))
            if len(self._warm) >= self.warmup:
                self._end_warmup(np.stack(self._warm))  # (warmup, K)
                self._warm.clear()
            if not upd.any():
                return
        a, sigma, lag = 1 - self.alpha, self.std, self.lag
        # the residual around the lagging level, clamped to ±z_thr·σ around its own running mean (the lag)
        err = np.where(upd, x - self.level, lag)
        err = np.clip(err, lag - z_thr * sigma, lag + z_thr * sigma)
        self.level = np.where(upd, self.level + a * err, self.level)
        self.lag = np.where(upd, lag + min(1.0, LAG_GAIN * a) * (err - lag), lag)
        self.var = np.where(upd, self.alpha * self.var + a * (err - lag) ** 2, self.var)

    def _end_warmup(self, warm: np.ndarray) -> None:
        """Robust statistics from the warm-up's samples ``warm`` (warmup, K), NaN where missing."""
        k = warm.shape[1]
        level, var = np.zeros(k), np.zeros(k)
        ready = np.isfinite(warm).sum(0) >= _MIN_LEVEL_SAMPLES
        for i in np.flatnonzero(ready):
            col = warm[:, i][np.isfinite(warm[:, i])]
            level[i] = np.median(col[-_tail(len(col)):])
            diffs = np.diff(col)
            var[i] = (_MAD_SIGMA * np.median(np.abs(diffs - np.median(diffs))) / np.sqrt(2)) ** 2
        new = ready & ~self.ready  # a channel already ready keeps its running statistics
        self.level = np.where(new, level, self.level)
        self.var, self.lag = np.where(new, var, self.var), np.where(new, 0.0, self.lag)
        self.ready = self.ready | ready


def _last_finite(col: np.ndarray, n: int) -> np.ndarray:
    """The last ``n`` finite entries of ``col``, NaN-padded in front to length ``n``."""
    vals = col[np.isfinite(col)][-n:]
    return np.concatenate([np.full(n - len(vals), np.nan), vals])


class ZClipEma:
    """ZClip's statistics (gradloc before issue 32): plain warm-up mean/variance, then EMA mean and
    variance, a sample entering clamped to μ + z_thr·σ. The same interface as :class:`EmaZ`."""

    def __init__(self, k: int, warmup: int, alpha: float, min_std_fraction: float) -> None:
        self.warmup, self.alpha, self.min_std_fraction = warmup, alpha, min_std_fraction
        self.mean = np.zeros(k)
        self.var = np.zeros(k)
        self._warm: list[np.ndarray] = []
        self.ready = np.zeros(k, dtype=bool)

    std = EmaZ.std
    z = EmaZ.z

    def warm_level(self) -> np.ndarray:
        return np.full(self.mean.shape, np.nan)  # ZClip judges nothing in its warm-up

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
