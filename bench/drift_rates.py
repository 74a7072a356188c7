"""The drift detector's findings on a stable run, where every one is false: per 1,000 judged steps (those after the
detector's warm-up), pages, and both per statistic. ``bench precursors`` scores its stable controls with it,
``bench healthy`` its no-fault runs (the findings the live monitor made: ``StepRecord.precursor_findings``).

:func:`replay` is the one way the benchmarks judge a finished run under other drift settings: its step records fed
to a fresh :class:`gradloc.engine.drift.DriftWatch` — the monitor's own path, ``observations(record, ...)`` and all —
so that at the live run's settings it makes the live findings (``bench precursors --replay``, ``bench healthy
--drift``)."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any, Iterable, Sequence

from gradloc.config import DriftConfig
from gradloc.engine.drift import DriftWatch
from gradloc.records import PrecursorFinding, StepRecord


def replay(records: Iterable[StepRecord], cfg: DriftConfig) -> list[PrecursorFinding]:
    """The findings a drift watch under ``cfg`` makes on a run's ``records``, step by step. Without the steps'
    micro-batches (a record does not keep them) a driver says micro-batch, row and position, not the sample id;
    in a multi-rank job's records (the job's values on every rank) every finding of the job is this rank's."""
    watch = DriftWatch(cfg, Counter())
    found: list[PrecursorFinding] = []
    for rec in records:
        found.extend(watch.watch_step(replace(rec, precursor_findings=()), ()).precursor_findings)
    if watch.counters["drift_errors"]:
        raise RuntimeError(f"the drift detector failed on {watch.counters['drift_errors']} replayed steps")
    return found


def key(f: PrecursorFinding) -> tuple[Any, ...]:
    """What a replay must reproduce of a live finding: all of it but the drivers' sample ids (the micro-batches)."""
    drivers = tuple((d.step, d.micro_batch, d.sample, d.position, d.rank) for d in f.drivers)
    return (f.step, f.statistic, f.layer, f.head, str(f.trend), f.pages, f.since_step, round(f.z, 9), drivers)


def check_replay(records: Sequence[StepRecord], cfg: DriftConfig, what: str) -> list[PrecursorFinding]:
    """:func:`replay` under the live run's ``cfg``; raises unless it makes the run's live findings (else a replay
    under other settings would measure nothing real)."""
    found = replay(records, cfg)
    live = [f for r in records for f in r.precursor_findings]
    if sorted(map(key, found)) != sorted(map(key, live)):
        raise AssertionError(f"{what}: the drift replay's findings {[(f.step, f.statistic) for f in found][:10]} "
                             f"are not the live ones {[(f.step, f.statistic) for f in live][:10]}")
    return found


def control_rates(findings: Sequence[Any], judged: int) -> dict[str, Any]:
    """``findings``: the run's :class:`~gradloc.records.PrecursorFinding` s; ``judged``: its steps after the warm-up."""
    judged = max(0, judged)
    per_stat = Counter(f.statistic for f in findings)
    return dict(judged_steps=judged, findings_per_1000=round(1000 * len(findings) / max(1, judged), 2),
                pages=sum(f.pages for f in findings),
                per_statistic={k: dict(findings=n, per_1000=round(1000 * n / max(1, judged), 2),
                                       pages=sum(f.pages for f in findings if f.statistic == k))
                               for k, n in per_stat.items()})


def rates(findings: Sequence[Any], judged: int) -> dict[str, Any]:
    """:func:`control_rates` with the count and where they were: (step, statistic, layer, pages) of each."""
    return dict(control_rates(findings, judged), count=len(findings),
                at=[(f.step, f.statistic, f.layer, f.pages) for f in findings][:50])


def run_rates(records: Sequence[Any], warmup: int) -> dict[str, Any]:
    """One run's live findings (every step's ``precursor_findings``) as :func:`rates`."""
    return rates([f for r in records for f in getattr(r, "precursor_findings", ())], len(records) - warmup)


def replay_rates(records: Sequence[StepRecord], cfg: DriftConfig) -> dict[str, Any]:
    """One run's findings under ``cfg`` (:func:`replay`) as :func:`rates`."""
    return rates(replay(records, cfg), len(records) - cfg.warmup)


def pooled(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' :func:`rates` together: findings and pages per 1,000 of all their judged steps."""
    judged = sum(r["judged_steps"] for r in rows)
    n = sum(r["count"] for r in rows)
    return dict(judged_steps=judged, findings=n, findings_per_1000=round(1000 * n / max(1, judged), 2),
                pages=sum(r["pages"] for r in rows), runs_over_1_per_1000=sum(r["findings_per_1000"] > 1.0 for r in rows))
