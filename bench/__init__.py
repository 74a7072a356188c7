"""Benchmarks for gradloc: ``python -m bench overhead|localization [--json] [--quick]``.

See docs/BENCHMARKS.md for what each one measures and the numbers measured on this machine.
"""
from __future__ import annotations

from gradloc.demo.run import torch_threads  # one helper for the demos and the benchmarks

__all__ = ["torch_threads"]
