"""The ``quarantine`` table (schema 6): samples and sources kept out of the next run
(:class:`~gradloc.records.QuarantineEntry`). One row per (kind, value); adding an entry that is there already
keeps the first (its reason and time stay the reason it was quarantined)."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from gradloc.records import QuarantineEntry
from gradloc.store.backends import Connection
from gradloc.store.rows import where

_SCHEMA = """
CREATE TABLE IF NOT EXISTS quarantine (
    kind        TEXT NOT NULL,  -- sample | origin | source
    value       TEXT NOT NULL,
    reason      TEXT NOT NULL,
    added_unix  REAL NOT NULL,
    job         TEXT,
    step        INTEGER,
    incident_id TEXT,
    PRIMARY KEY (kind, value)
);
CREATE INDEX IF NOT EXISTS quarantine_job ON quarantine (job) WHERE job IS NOT NULL
"""
_COLUMNS = "kind, value, reason, added_unix, job, step, incident_id"


def create(conn: Connection) -> None:
    """Create the table (idempotent: a migration, or a fresh file)."""
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)


Connect = Callable[[], AbstractContextManager[Connection]]


class Quarantine:
    """The store's quarantine list: ``write`` is the store's write transaction, ``read`` a pooled connection."""

    def __init__(self, write: Connect, read: Connect) -> None:
        self._write, self._read = write, read

    def add(self, entries: Sequence[QuarantineEntry]) -> int:
        """Add ``entries``; returns how many were new."""
        with self._write() as conn:
            return conn.executemany(f"INSERT INTO quarantine ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
                                    "ON CONFLICT DO NOTHING",
                                    list(_params(entries))).rowcount

    def remove(self, kind: str, value: str) -> bool:
        with self._write() as conn:
            return conn.execute("DELETE FROM quarantine WHERE kind = ? AND value = ?", (kind, value)).rowcount > 0

    def list(self, kind: str | None = None, job: str | None = None,
             incident_id: str | None = None) -> list[QuarantineEntry]:
        """Oldest first (the order they were quarantined in); ``incident_id``: what that incident put there."""
        cond, args = where(("kind = ?", kind), ("job = ?", job), ("incident_id = ?", incident_id))
        with self._read() as conn:
            rows = conn.execute(f"SELECT {_COLUMNS} FROM quarantine{cond} ORDER BY added_unix, kind, value", args)
            return [QuarantineEntry(kind=k, value=v, reason=r, added_unix=t, job=j, step=s, incident_id=i)
                    for k, v, r, t, j, s, i in rows]


def _params(entries: Sequence[QuarantineEntry]) -> Iterator[tuple[Any, ...]]:
    for e in entries:
        yield (str(e.kind), e.value, e.reason, e.added_unix, e.job, e.step, e.incident_id)


__all__ = ["Quarantine", "create"]
