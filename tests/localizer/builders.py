"""Small per-rank records for the correlator and agent tests: a step summary and a finding."""
from __future__ import annotations

import numpy as np

from gradloc.records import CulpritSpan, Incident, Localization, SpikeEvent, TokenStats
from gradloc.reports import LayerColumns, StepSummary


def summary(job: str, rank: int, step: int, total_score: float | None = 1.0,
            mb_shares: tuple[float, ...] = (0.5, 0.5)) -> StepSummary:
    cols = LayerColumns.build(("a",), [1.0], [1.0], [0], [1.0], [4], [np.nan])
    tokens = None if total_score is None else TokenStats(64, total_score, (), 0.1, mb_shares, 0.0)
    return StepSummary(job, rank, step, 1000.0 + step, 2.0 + rank, 3.0, len(mb_shares), cols, tokens)


def finding(job: str, rank: int, step: int, share: float = 0.8, text: str = " bad") -> Incident:
    spike = SpikeEvent(step, ("grad_spike",), 5.0, 9.0, 1.0, 0.3, layers=("head",))
    span = CulpritSpan(1, 0, 7, 8, share, (42,), text, "before", "after", f"s{rank}")
    loc = Localization(step, "attribution", "located", 1, share, 5.0, 4.0, 1.0, (), (span,))
    return Incident(f"r{rank}", job, rank, step, 1000.0 + step + rank, spike, loc)
