"""Benchmarks for gradloc: ``python -m bench overhead|localization [--json] [--quick]``.

See docs/BENCHMARKS.md for what each one measures and the numbers measured on this machine.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` intra-op threads (None: leave torch's setting), restoring the old count."""
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
