"""``StateConfig``: the telemetry state's cardinality bounds (exporters/state.py)."""
from __future__ import annotations

from dataclasses import dataclass

from gradloc.errors import ConfigError


@dataclass(frozen=True)
class StateConfig:
    max_series: int = 4096  # (job, rank) pairs with live gauges
    max_layers: int = 1024  # layer labels per rank
    stale_after_s: float = 900.0
    sources: tuple[str, ...] = ()  # data sources that always get their own ``source`` label (exporters/source_labels.py)
    max_sources: int = 16  # other sources labelled by name, first seen first; later ones are "other"

    def __post_init__(self) -> None:
        if self.max_series < 1 or self.max_layers < 1 or self.max_sources < 0:
            raise ConfigError("max_series and max_layers must be >= 1, max_sources >= 0")
        if not self.stale_after_s > 0:
            raise ConfigError("stale_after_s must be > 0")


__all__ = ["StateConfig"]
