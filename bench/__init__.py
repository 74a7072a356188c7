"""Benchmarks for gradloc: ``python -m bench overhead|localization [--json] [--quick]``.

See docs/BENCHMARKS.md for what each one measures and the numbers measured on this machine.

``torch_threads`` (one helper for the demos and the benchmarks) is imported on first use: the package itself
imports nothing, so a benchmark that never touches torch (``soak``, ``agent``: the daemon and its clients) and
the processes it spawns do not pay torch's import (~8 s on a busy 2-core machine).
"""
from __future__ import annotations

from typing import Any

__all__ = ["torch_threads"]


def __getattr__(name: str) -> Any:
    if name == "torch_threads":
        from gradloc.demo.run import torch_threads

        return torch_threads
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
