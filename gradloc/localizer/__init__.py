"""Localization: one spike → the token spans behind it, on one rank or a job's ranks together (the
cross-job correlation of records the agent receives is the agent's: ``agent/correlator.py``).

Names are imported on first use (the localizer needs torch; importing the package alone does not).
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
