"""Typed configuration, validated on construction (invalid values raise :class:`~gradloc.errors.ConfigError`).

``options.py``: the closed sets of string options and the shared checks; ``stages.py``: the detector's, the
classifier's, the localizer's and the per-sample judge's configs; ``watch.py``: ``WatchConfig``, what a monitor
measures and where it sends it. Everything is imported from here (``from gradloc.config import WatchConfig``).
"""
from gradloc.config.options import (
    LEAN_SWEEP_STEPS,
    MEMORY_BUDGET_FRACTION,
    MEMORY_RESERVE,
    MIN_MEMORY_BUDGET,
    REMEDIES,
    UPDATE_RATIO_MODES,
    BisectionPolicy,
    DistributedMode,
    LayerGrouping,
    RemedyAction,
    Sensitivity,
    TokenStatsMode,
    UpdateRatioMode,
    finite_or_none,
)
from gradloc.config.precursors import DriftConfig, PrecursorConfig
from gradloc.config.stages import BISECTION_POLICIES, ClassifierConfig, DetectorConfig, LocalizerConfig, SampleConfig
from gradloc.config.watch import WatchConfig

__all__ = ["BISECTION_POLICIES", "LEAN_SWEEP_STEPS", "MEMORY_BUDGET_FRACTION", "MEMORY_RESERVE", "MIN_MEMORY_BUDGET",
           "REMEDIES", "UPDATE_RATIO_MODES", "BisectionPolicy", "ClassifierConfig", "DetectorConfig", "DistributedMode",
           "DriftConfig", "LayerGrouping", "LocalizerConfig", "PrecursorConfig", "RemedyAction", "SampleConfig",
           "Sensitivity", "TokenStatsMode", "UpdateRatioMode", "WatchConfig", "finite_or_none"]
