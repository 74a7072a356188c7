"""The drift detector's findings on a stable run, where every one is false: per 1,000 judged steps (those after the
detector's warm-up), pages, and both per statistic. ``bench precursors`` scores its stable controls with it,
``bench healthy`` its no-fault runs (the findings the live monitor made: ``StepRecord.precursor_findings``)."""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence


def control_rates(findings: Sequence[Any], judged: int) -> dict[str, Any]:
    """``findings``: the run's :class:`~gradloc.records.PrecursorFinding` s; ``judged``: its steps after the warm-up."""
    judged = max(0, judged)
    per_stat = Counter(f.statistic for f in findings)
    return dict(judged_steps=judged, findings_per_1000=round(1000 * len(findings) / max(1, judged), 2),
                pages=sum(f.pages for f in findings),
                per_statistic={k: dict(findings=n, per_1000=round(1000 * n / max(1, judged), 2),
                                       pages=sum(f.pages for f in findings if f.statistic == k))
                               for k, n in per_stat.items()})


def run_rates(records: Sequence[Any], warmup: int) -> dict[str, Any]:
    """One run's live findings (every step's ``precursor_findings``) as :func:`control_rates`, with where they
    were: (step, statistic, layer, pages) of each."""
    found = [f for r in records for f in getattr(r, "precursor_findings", ())]
    return dict(control_rates(found, len(records) - warmup), count=len(found),
                at=[(f.step, f.statistic, f.layer, f.pages) for f in found][:50])


def pooled(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' :func:`run_rates` together: findings and pages per 1,000 of all their judged steps."""
    judged = sum(r["judged_steps"] for r in rows)
    n = sum(r["count"] for r in rows)
    return dict(judged_steps=judged, findings=n, findings_per_1000=round(1000 * n / max(1, judged), 2),
                pages=sum(r["pages"] for r in rows), runs_over_1_per_1000=sum(r["findings_per_1000"] > 1.0 for r in rows))
