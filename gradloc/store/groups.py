"""The ``step_groups`` table (schema 7): each step's samples and loss tokens per data group (``StepSummary.groups``:
source, tag, length bucket), what ``gradloc-agent patterns`` divides culprits and outliers by.

Written in the same transaction as the steps; a re-sent step replaces its rows. Retention: the store's
``max_age_days``, and at most :data:`MAX_ROWS` rows (oldest go first).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from gradloc.reports import StepSummary
from gradloc.store.backends import Connection
from gradloc.store.rows import replace_step_rows, where

MAX_ROWS = 2_000_000  # ~20 groups per step × 100,000 steps
_SCHEMA = """
CREATE TABLE IF NOT EXISTS step_groups (
    job       TEXT NOT NULL,
    rank      INTEGER NOT NULL,
    step      INTEGER NOT NULL,
    time_unix REAL NOT NULL,
    kind      TEXT NOT NULL,  -- source | tag | length (gradloc.records.GroupKind)
    name      TEXT NOT NULL,
    samples   INTEGER NOT NULL,
    tokens    INTEGER NOT NULL,
    PRIMARY KEY (job, step, rank, kind, name)
);
CREATE INDEX IF NOT EXISTS step_groups_time ON step_groups (time_unix)
"""
_INSERT = "INSERT INTO step_groups (job, rank, step, time_unix, kind, name, samples, tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"


def create(conn: Connection) -> None:
    """Create the table (idempotent: a migration, or a fresh file)."""
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)


def put(conn: Connection, steps: Sequence[StepSummary]) -> int:
    """Write the groups of ``steps`` inside the caller's transaction; returns the rows written."""
    with_groups = [s for s in steps if s.groups]
    if not with_groups:
        return 0
    return replace_step_rows(conn, "step_groups", with_groups, _INSERT, _params(with_groups))


def _params(steps: Sequence[StepSummary]) -> Iterator[tuple[Any, ...]]:
    for s in steps:
        for g in s.groups:
            yield s.job, s.rank, s.step, s.time_unix, str(g.kind), g.name, g.samples, g.tokens


def totals(conn: Connection, job: str | None, since_unix: float | None,
           until_unix: float | None) -> list[tuple[str, str, int, int]]:
    """(kind, name, samples, tokens) summed over ranks and steps in the window, largest token count first."""
    cond, args = where(("job = ?", job), ("time_unix >= ?", since_unix), ("time_unix < ?", until_unix))
    sql = (f"SELECT kind, name, SUM(samples), SUM(tokens) FROM step_groups{cond} GROUP BY kind, name "
           "ORDER BY SUM(tokens) DESC, kind, name")
    return [(k, n, int(a), int(b)) for k, n, a, b in conn.execute(sql, args)]


def prune(conn: Connection, max_age_days: float | None, now: float) -> int:
    """Delete rows older than ``max_age_days`` and the oldest past :data:`MAX_ROWS`; returns the rows deleted."""
    n = 0
    if max_age_days is not None:
        n += conn.execute("DELETE FROM step_groups WHERE time_unix < ?", (now - max_age_days * 86400,)).rowcount
    count = conn.execute("SELECT count(*) FROM step_groups").fetchone()[0]
    if count > MAX_ROWS:
        cutoff = conn.execute("SELECT time_unix FROM step_groups ORDER BY time_unix DESC LIMIT 1 OFFSET ?",
                              (MAX_ROWS,)).fetchone()[0]
        n += conn.execute("DELETE FROM step_groups WHERE time_unix <= ?", (cutoff,)).rowcount
    return n
