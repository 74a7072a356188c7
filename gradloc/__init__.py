"""gradloc: locate the tokens behind a training run's gradient spikes.

The trainer-side API (``watch``, ``Monitor``) needs torch; it is imported on first use, so the
agent daemon, the CLI and the exporters run without importing torch (the daemon's memory budget).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "watch": "gradloc.adapters.pytorch", "Monitor": "gradloc.adapters.pytorch",
    "StepReport": "gradloc.adapters.pytorch",
    "register_rule": "gradloc.collector.rules", "register_duck_rule": "gradloc.collector.rules",
    "WatchConfig": "gradloc.config", "DetectorConfig": "gradloc.config",
    "LocalizerConfig": "gradloc.config",
    "GradlocError": "gradloc.errors", "ConfigError": "gradloc.errors", "AttachError": "gradloc.errors",
    "UnsupportedModelError": "gradloc.errors", "BatchMetadataError": "gradloc.errors",
    "ProbeError": "gradloc.errors",
    "StepRecord": "gradloc.records", "LayerStats": "gradloc.records", "TokenScore": "gradloc.records",
    "TokenStats": "gradloc.records", "SpikeEvent": "gradloc.records", "Culprit": "gradloc.records",
    "CulpritSpan": "gradloc.records", "Localization": "gradloc.records", "Incident": "gradloc.records",
    "SampleInfo": "gradloc.records", "TokenRL": "gradloc.records", "Classification": "gradloc.records",
    "RLStats": "gradloc.records", "SampleShare": "gradloc.records", "Remedy": "gradloc.records",
    "to_dict": "gradloc.records",
    "SampleConfig": "gradloc.config", "SampleOutlier": "gradloc.records", "SampleStats": "gradloc.records",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gradloc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
