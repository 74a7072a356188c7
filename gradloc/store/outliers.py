"""The ``sample_outliers`` table: per-sample findings (``SampleOutlier``), kept beside the incidents.

Findings arrive inside step summaries (``StepSummary.samples.outliers``) and are written in the
same transaction as their steps. A re-sent step (delivery is at least once) replaces its findings.
Retention: the store's ``max_age_days``, and at most :data:`MAX_ROWS` rows (oldest go first).
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from gradloc.records import SampleInfo, SampleOutlier, to_dict
from gradloc.reports import StepSummary
from gradloc.store.backends import Connection
from gradloc.store.rows import newest_first, replace_step_rows, where

MAX_ROWS = 100_000
COLUMNS = ("job, rank, step, time_unix, kind, score, z, baseline, micro_batch, sample, sample_id, start, "
           '"end", tokens, text, detail, source, origin, info')
_INSERT = f"INSERT INTO sample_outliers ({COLUMNS}) VALUES ({', '.join('?' * 19)})"
PROVENANCE = (("source", "TEXT"), ("origin", "TEXT"), ("info", "TEXT"))  # schema 5: the sample's SampleInfo
_SCHEMA = """
CREATE TABLE IF NOT EXISTS sample_outliers (
    job         TEXT NOT NULL,
    rank        INTEGER NOT NULL,
    step        INTEGER NOT NULL,
    time_unix   REAL NOT NULL,
    kind        TEXT NOT NULL,
    score       REAL NOT NULL,
    z           REAL NOT NULL,
    baseline    REAL NOT NULL,
    micro_batch INTEGER,
    sample      INTEGER,
    sample_id   TEXT,
    start       INTEGER,
    "end"       INTEGER,
    tokens      INTEGER NOT NULL,
    text        TEXT,
    detail      TEXT NOT NULL,
    source      TEXT,  -- SampleInfo.source (queried by source)
    origin      TEXT,  -- SampleInfo.origin
    info        TEXT   -- the whole SampleInfo, JSON (records.to_dict)
);
CREATE INDEX IF NOT EXISTS sample_outliers_time ON sample_outliers (time_unix);
CREATE INDEX IF NOT EXISTS sample_outliers_job_step ON sample_outliers (job, step, rank);
CREATE INDEX IF NOT EXISTS sample_outliers_sample_id ON sample_outliers (sample_id) WHERE sample_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS sample_outliers_source ON sample_outliers (source) WHERE source IS NOT NULL;
"""


def create(conn: Connection) -> None:
    """Create the table and its indexes (idempotent: a migration, or a fresh file)."""
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)


def add_provenance(conn: Connection) -> None:
    """Schema 4 → 5: the provenance columns, on a table made before them (a table made by :func:`create` since
    has them already). SQLite files only (PRAGMA): PostgreSQL stores begin at schema 6."""
    have = {row[1] for row in conn.execute("PRAGMA table_info(sample_outliers)")}
    for name, kind in PROVENANCE:
        if name not in have:
            conn.execute(f"ALTER TABLE sample_outliers ADD COLUMN {name} {kind}")
    conn.execute("CREATE INDEX IF NOT EXISTS sample_outliers_source ON sample_outliers (source) "
                 "WHERE source IS NOT NULL")


def put(conn: Connection, steps: Sequence[StepSummary]) -> int:
    """Write the findings of ``steps`` inside the caller's transaction; returns the rows written."""
    with_findings = [s for s in steps if s.samples is not None and s.samples.outliers]
    if not with_findings:
        return 0
    return replace_step_rows(conn, "sample_outliers", with_findings, _INSERT, _params(with_findings))


def _params(steps: Sequence[StepSummary]) -> Iterator[tuple[Any, ...]]:
    for s in steps:
        for o in s.samples.outliers:  # type: ignore[union-attr]
            info = o.sample_info
            yield (o.job, o.rank, o.step, o.time_unix, o.kind, o.score, o.z, o.baseline, o.micro_batch, o.sample,
                   o.sample_id, o.start, o.end, o.tokens, o.text, o.detail, info.source if info else None,
                   info.origin if info else None, json.dumps(to_dict(info), ensure_ascii=False) if info else None)


def select(conn: Connection, job: str | None, kind: str | None, since_unix: float | None,
           limit: int | None) -> list[SampleOutlier]:
    """Newest first."""
    filters = where(("job = ?", job), ("kind = ?", kind), ("time_unix >= ?", since_unix))
    return [_row(r) for r in newest_first(conn, "sample_outliers", COLUMNS, filters, limit)]


def _row(r: Sequence[Any]) -> SampleOutlier:
    (job, rank, step, time_unix, kind, score, z, baseline, mb, sample, sample_id, start, end, tokens, text,
     detail, _source, _origin, info) = r
    return SampleOutlier(kind=kind, job=job, rank=rank, step=step, time_unix=time_unix, score=score, z=z,
                         baseline=baseline, micro_batch=mb, sample=sample, sample_id=sample_id, start=start, end=end,
                         tokens=tokens, text=text, detail=detail, sample_info=_info(info))


def _info(text: str | None) -> SampleInfo | None:
    if text is None:
        return None
    d = json.loads(text)
    return SampleInfo(**{**d, "tags": tuple(tuple(t) for t in d.get("tags", ()))})


def prune(conn: Connection, max_age_days: float | None, now: float) -> int:
    """Delete findings older than ``max_age_days`` and beyond :data:`MAX_ROWS`; returns the rows deleted."""
    n = 0
    if max_age_days is not None:
        n += conn.execute("DELETE FROM sample_outliers WHERE time_unix < ?", (now - max_age_days * 86400.0,)).rowcount
    n += conn.execute("DELETE FROM sample_outliers WHERE rowid IN (SELECT rowid FROM sample_outliers "
                      "ORDER BY time_unix DESC, rowid DESC LIMIT -1 OFFSET ?)", (MAX_ROWS,)).rowcount
    return n
