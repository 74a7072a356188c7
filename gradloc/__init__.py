"""gradloc: locate the tokens behind a training run's gradient spikes."""
from gradloc.adapters.pytorch import Monitor, StepReport, watch
from gradloc.collector.rules import register_duck_rule, register_rule
from gradloc.config import DetectorConfig, LocalizerConfig, WatchConfig
from gradloc.errors import (
    AttachError,
    BatchMetadataError,
    ConfigError,
    GradlocError,
    ProbeError,
    UnsupportedModelError,
)
from gradloc.records import (
    Culprit,
    CulpritSpan,
    Incident,
    LayerStats,
    Localization,
    SpikeEvent,
    StepRecord,
    TokenScore,
    TokenStats,
    to_dict,
)

__version__ = "0.1.0"

__all__ = [
    "watch", "Monitor", "StepReport", "WatchConfig", "DetectorConfig", "LocalizerConfig",
    "register_rule", "register_duck_rule", "GradlocError", "ConfigError", "AttachError",
    "UnsupportedModelError", "BatchMetadataError", "ProbeError", "StepRecord", "LayerStats",
    "TokenScore", "TokenStats", "SpikeEvent", "Culprit", "CulpritSpan", "Localization", "Incident",
    "to_dict",
]
