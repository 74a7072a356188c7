"""Localization: one spike → the token spans behind it (per rank), and across ranks (correlator).

The per-rank localizer needs torch (probes); the correlator runs in the agent daemon, which must not
import torch — so the torch-side names are imported on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Localizer": "gradloc.localizer.localizer", "SpikeContext": "gradloc.localizer.localizer",
    "StoredGradient": "gradloc.localizer.localizer", "ProbeFn": "gradloc.localizer.probes",
    "ProbeSession": "gradloc.localizer.probes", "TokenView": "gradloc.localizer.token_view",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'gradloc.localizer' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
