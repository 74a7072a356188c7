"""Spike detection on step records. Observability only: it never clips or changes the update.

Kinds a :class:`SpikeEvent` can carry (``LOCALIZE`` ones trigger the localizer):
``grad_spike`` (global-norm z > z_threshold), ``abs_threshold`` (global norm > abs_threshold),
``layer_spike`` (some layer's own z > layer_z_threshold), ``nonfinite_grad``, ``nonfinite_loss``,
``loss_spike`` (loss z > loss_z_threshold), ``divergence`` (the fast EMA of the global norm stayed
above (1 + margin) × the slow EMA for ``divergence_patience`` steps), ``skipped_step`` (GradScaler
found inf/NaN and will skip the update — normal while the scale calibrates, so not localized).
"""
from __future__ import annotations

import math

import numpy as np

from gradloc.config import DetectorConfig
from gradloc.detector.ema import EmaZ
from gradloc.records import SpikeEvent, StepRecord

LOCALIZE = frozenset({"grad_spike", "abs_threshold", "layer_spike", "nonfinite_grad", "loss_spike"})
_FAST_ALPHA = 0.7


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


class SpikeDetector:
    def __init__(self, config: DetectorConfig, layers: list[str]) -> None:
        self.config = config
        self.layers = list(layers)
        c = config
        self._global = EmaZ(1, c.warmup, c.alpha, c.min_std_fraction)
        self._loss = EmaZ(1, c.warmup, c.alpha, c.min_std_fraction)
        self._layers = EmaZ(len(layers), c.warmup, c.alpha, c.min_std_fraction)
        self._fast: float | None = None
        self._rising = 0

    def healthy_norm(self) -> float | None:
        """EMA mean of the global norm (None during warm-up): the localizer's noise reference."""
        return float(self._global.mean[0]) if self._global.ready[0] else None

    def z_of(self, global_norm: float) -> float | None:
        z = float(self._global.z(np.array([global_norm]))[0])
        return z if math.isfinite(z) else None

    def observe(self, rec: StepRecord) -> SpikeEvent:
        c = self.config
        kinds: list[str] = []
        g = rec.global_norm
        if rec.skipped:
            kinds.append("skipped_step")
        elif rec.nonfinite > 0 or not math.isfinite(g):
            kinds.append("nonfinite_grad")
        if rec.loss is not None and not math.isfinite(rec.loss):
            kinds.append("nonfinite_loss")
        z = self.z_of(g) if math.isfinite(g) else None
        if z is not None and z > c.z_threshold:
            kinds.append("grad_spike")
        if c.abs_threshold is not None and math.isfinite(g) and g > c.abs_threshold:
            kinds.append("abs_threshold")
        hot_layers = self._layer_spikes(rec)
        if hot_layers:
            kinds.append("layer_spike")
        loss_z = None
        if _finite(rec.loss):
            lz = float(self._loss.z(np.array([rec.loss]))[0])
            loss_z = lz if math.isfinite(lz) else None
            if loss_z is not None and loss_z > c.loss_z_threshold:
                kinds.append("loss_spike")
            self._loss.update(np.array([rec.loss]), c.loss_z_threshold)
        if math.isfinite(g) and not rec.skipped:
            if self._divergence(g):
                kinds.append("divergence")
            self._global.update(np.array([g]), c.z_threshold)
        mean = self.healthy_norm()
        std = float(self._global.std[0]) if mean is not None else None
        return SpikeEvent(rec.step, tuple(kinds), g, z, mean, std, rec.loss, loss_z, hot_layers)

    def _layer_spikes(self, rec: StepRecord) -> tuple[str, ...]:
        if not self.layers:
            return ()
        by_name = {s.layer: s.grad_norm for s in rec.layers}
        x = np.array([by_name.get(name, np.nan) for name in self.layers], dtype=float)
        if rec.skipped:
            return ()
        z = self._layers.z(x)
        self._layers.update(x, self.config.layer_z_threshold)
        with np.errstate(invalid="ignore"):
            hot = np.nan_to_num(z, nan=-np.inf) > self.config.layer_z_threshold
        order = np.argsort(-np.nan_to_num(z, nan=-np.inf))
        return tuple(self.layers[i] for i in order if hot[i])

    def _divergence(self, g: float) -> bool:
        self._fast = g if self._fast is None else _FAST_ALPHA * self._fast + (1 - _FAST_ALPHA) * g
        slow = self.healthy_norm()
        if slow is None:
            return False
        self._rising = self._rising + 1 if self._fast > (1 + self.config.divergence_margin) * slow else 0
        if self._rising >= self.config.divergence_patience:
            self._rising = 0
            return True
        return False
