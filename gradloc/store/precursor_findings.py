"""The ``precursor_findings`` table (schema 8): the drift detector's findings (``PrecursorFinding``), kept beside the
incidents like the per-sample findings (gradloc/store/outliers.py).

Findings arrive inside step summaries (``StepSummary.precursor_findings``) and are written in the same transaction as
their steps. A re-sent step (delivery is at least once) replaces its findings. A paging finding is a row of its own
(``pages`` = 1), a second finding of the same series. ``drivers`` is a JSON array of ``PrecursorDriver`` records
(``records.to_dict``, provenance included). Retention: the store's ``max_age_days``, and at most :data:`MAX_ROWS`
rows (oldest go first). NULL in a REAL column is NaN (the store's convention); ``change`` may be +inf (a drift from a
zero baseline).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

from gradloc.records import PrecursorDriver, PrecursorFinding, to_dict
from gradloc.reports import StepSummary
from gradloc.store.backends import Connection
from gradloc.store.incident_json import record_from_dict
from gradloc.store.rows import newest_first, replace_step_rows, where

MAX_ROWS = 100_000
COLUMNS = ("job, rank, step, time_unix, statistic, layer, head, trend, value, baseline, z, change, rate, since_step, "
           "pages, drivers, detail")
_INSERT = f"INSERT INTO precursor_findings ({COLUMNS}) VALUES ({', '.join('?' * 17)})"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS precursor_findings (
    job        TEXT NOT NULL,
    rank       INTEGER NOT NULL,
    step       INTEGER NOT NULL,
    time_unix  REAL NOT NULL,
    statistic  TEXT NOT NULL,  -- gradloc.records.precursors.STATISTICS
    layer      TEXT NOT NULL,
    head       INTEGER,
    trend      TEXT NOT NULL,  -- rising | falling | oscillating
    value      REAL,
    baseline   REAL,
    z          REAL,
    change     REAL,
    rate       REAL,
    since_step INTEGER NOT NULL,
    pages      INTEGER NOT NULL,  -- 1: the paging finding of its series
    drivers    TEXT NOT NULL,  -- JSON array of PrecursorDriver (records.to_dict)
    detail     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS precursor_findings_time ON precursor_findings (time_unix);
CREATE INDEX IF NOT EXISTS precursor_findings_job_step ON precursor_findings (job, step, rank);
CREATE INDEX IF NOT EXISTS precursor_findings_statistic ON precursor_findings (statistic, time_unix)
"""


def create(conn: Connection) -> None:
    """Create the table and its indexes (idempotent: the 7 → 8 migration, or a fresh store)."""
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)


def put(conn: Connection, steps: Sequence[StepSummary]) -> int:
    """Write the findings of ``steps`` inside the caller's transaction; returns the rows written."""
    with_findings = [s for s in steps if s.precursor_findings]
    if not with_findings:
        return 0
    return replace_step_rows(conn, "precursor_findings", with_findings, _INSERT, _params(with_findings))


def _params(steps: Sequence[StepSummary]) -> Iterator[tuple[Any, ...]]:
    for s in steps:
        for f in s.precursor_findings:
            yield (f.job, f.rank, f.step, f.time_unix, f.statistic, f.layer, f.head, str(f.trend), f.value, f.baseline,
                   f.z, f.change, f.rate, f.since_step, int(f.pages),
                   json.dumps([to_dict(d) for d in f.drivers], ensure_ascii=False), f.detail)


def select(conn: Connection, job: str | None, statistic: str | None, pages: bool | None, since_unix: float | None,
           limit: int | None, steps: tuple[int, int] | None = None) -> list[PrecursorFinding]:
    """Newest first; ``steps``: only findings of steps first..last (inclusive)."""
    first, last = steps if steps is not None else (None, None)
    filters = where(("job = ?", job), ("statistic = ?", statistic), ("pages = ?", None if pages is None else int(pages)),
                    ("time_unix >= ?", since_unix), ("step >= ?", first), ("step <= ?", last))
    return [_row(r) for r in newest_first(conn, "precursor_findings", COLUMNS, filters, limit)]


def _row(r: Sequence[Any]) -> PrecursorFinding:
    (job, rank, step, time_unix, statistic, layer, head, trend, value, baseline, z, change, rate, since_step, pages,
     drivers, detail) = r
    return PrecursorFinding(job=job, rank=rank, step=step, time_unix=time_unix, statistic=statistic, layer=layer,
                            head=head, trend=trend, value=_real(value), baseline=_real(baseline), z=_real(z),
                            change=_real(change), rate=_real(rate), since_step=since_step, pages=bool(pages),
                            drivers=record_from_dict(tuple[PrecursorDriver, ...], json.loads(drivers), "drivers"),
                            detail=detail)


def _real(x: float | None) -> float:
    return math.nan if x is None else float(x)


def prune(conn: Connection, max_age_days: float | None, now: float) -> int:
    """Delete findings older than ``max_age_days`` and beyond :data:`MAX_ROWS`; returns the rows deleted."""
    n = 0
    if max_age_days is not None:
        n += conn.execute("DELETE FROM precursor_findings WHERE time_unix < ?",
                          (now - max_age_days * 86400.0,)).rowcount
    n += conn.execute("DELETE FROM precursor_findings WHERE rowid IN (SELECT rowid FROM precursor_findings "
                      "ORDER BY time_unix DESC, rowid DESC LIMIT -1 OFFSET ?)", (MAX_ROWS,)).rowcount
    return n
