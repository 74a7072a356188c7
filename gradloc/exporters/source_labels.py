"""The bounded ``source`` label of the per-source series: a data source's name becomes a label value only if it is
configured, or among the first ``max_sources`` distinct sources seen; every later one is ``other``.

First-seen rather than top-N by tokens: a counter's label cannot move once exported (a source that grows into the
top N later would split its history across two series). Sources are a small set by contract (a mixture's
components: records/provenance.py); sample ids, origins and tags never become labels.
"""
from __future__ import annotations

OTHER = "other"


class SourceLabels:
    """Source name → label value, bounded; not thread-safe (the state calls it under its lock)."""

    def __init__(self, configured: tuple[str, ...] = (), max_sources: int = 16) -> None:
        self._labels = dict.fromkeys(configured)
        self.max_sources = max_sources
        self._dynamic = 0

    def label(self, source: str) -> str:
        if source in self._labels:
            return source
        if self._dynamic >= self.max_sources or source == OTHER:
            return OTHER
        self._dynamic += 1
        self._labels[source] = None
        return source
