"""SQLite schema of the incident store, and how a connection is opened.

The schema version lives in ``PRAGMA user_version`` (0 = a fresh file). A database written by a
newer gradloc is refused rather than read: a newer schema may have moved meaning between columns,
and a daemon that "mostly works" on it would write rows the newer reader misreads. Older versions
are upgraded in place by the steps in ``_MIGRATIONS`` (1 → 2 adds the inbox, 2 → 3 the
``sample_outliers`` table of per-sample findings, gradloc/store/outliers.py, 3 → 4 the
``finding_ids`` of each incident's rank findings, gradloc/store/aliases.py, 4 → 5 the outliers' provenance
columns, 5 → 6 the quarantine, gradloc/store/quarantine.py, 6 → 7 the per-step data groups,
gradloc/store/groups.py, and the spans' source and origin, gradloc/store/history.py).
"""
from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable

from gradloc.store import aliases, groups, history, inbox, outliers, quarantine
from gradloc.store.errors import SchemaVersionError, StoreError

SCHEMA_VERSION = 7  # 2: the inbox (gradloc/store/inbox.py); 3: sample_outliers (gradloc/store/outliers.py);
# 4: finding_ids (gradloc/store/aliases.py); 5: the outliers' provenance (source, origin, info); 6: the quarantine
# (gradloc/store/quarantine.py); 7: step_groups (gradloc/store/groups.py) and the spans' source and origin
# (gradloc/store/history.py)
BUSY_TIMEOUT_MS = 5000

# NULL in a REAL column means "unknown or NaN" (SQLite stores NaN as NULL); the ``json`` column keeps
# the distinction. ``kinds``, ``ranks_missing`` and ``token_ids`` are JSON arrays (usable with json_each).
_SCHEMA_V1 = """
CREATE TABLE incidents (
    incident_id     TEXT PRIMARY KEY NOT NULL,
    trace_id        TEXT NOT NULL,
    job             TEXT NOT NULL,
    step            INTEGER NOT NULL,
    time_unix       REAL NOT NULL,
    status          TEXT NOT NULL,
    kinds           TEXT NOT NULL,
    global_norm     REAL,
    ranks_missing   TEXT NOT NULL,
    explained_share REAL,
    probes          INTEGER NOT NULL,
    json            TEXT NOT NULL
);
CREATE INDEX incidents_time ON incidents (time_unix);
CREATE INDEX incidents_job_time ON incidents (job, time_unix);
CREATE TABLE spans (
    incident_id TEXT NOT NULL REFERENCES incidents (incident_id) ON DELETE CASCADE,
    idx         INTEGER NOT NULL,
    rank        INTEGER NOT NULL,
    micro_batch INTEGER NOT NULL,
    sample      INTEGER NOT NULL,
    start       INTEGER NOT NULL,
    "end"       INTEGER NOT NULL,
    share       REAL,
    text        TEXT,
    token_ids   TEXT NOT NULL,
    sample_id   TEXT,
    PRIMARY KEY (incident_id, idx)
);
CREATE INDEX spans_sample_id ON spans (sample_id) WHERE sample_id IS NOT NULL;
CREATE TABLE steps (
    job                TEXT NOT NULL,
    rank               INTEGER NOT NULL,
    step               INTEGER NOT NULL,
    time_unix          REAL NOT NULL,
    global_norm        REAL,
    loss               REAL,
    top_share          REAL,
    unattributed_share REAL,
    nonfinite          INTEGER NOT NULL,
    skipped            INTEGER NOT NULL
);
CREATE UNIQUE INDEX steps_job_step ON steps (job, step, rank);
CREATE INDEX steps_time ON steps (time_unix);
"""

def _groups_and_span_provenance(conn: sqlite3.Connection) -> None:
    groups.create(conn)
    history.add_span_provenance(conn)


_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {1: inbox.create, 2: outliers.create,
                                                                3: aliases.create,
                                                                4: outliers.add_provenance,
                                                                5: quarantine.create,
                                                                6: _groups_and_span_provenance}  # v -> v + 1


def connect(path: str) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL, foreign keys on.

    WAL lets the daemon's HTTP readers run while its writer commits; ``synchronous=NORMAL`` is safe
    in WAL (a power cut can lose the last commits, never corrupt the file) and keeps commits cheap.
    """
    try:
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                               check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{path}: cannot open as an incident store ({exc})") from exc
    if str(mode).lower() != "wal":
        conn.close()
        raise StoreError(f"{path}: SQLite refused WAL mode (got {mode!r}); use a file on a local disk")
    return conn


def ensure_schema(conn: sqlite3.Connection, path: str) -> None:
    """Create the schema on a fresh file, upgrade an older one, refuse a newer one.

    The usual case (already current) only reads, so a CLI reader never takes the write lock and
    works on a file it may not write.
    """
    version = _version(conn, path)
    if version == SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")  # one creator even if two processes open a fresh file at once
    try:
        version = _version(conn, path)
        if version == 0:
            _create(conn, path)
        while 0 < version < SCHEMA_VERSION:
            _MIGRATIONS[version](conn)
            version += 1
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _version(conn: sqlite3.Connection, path: str) -> int:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{path} has incident-store schema version {version}, but this gradloc reads versions up "
            f"to {SCHEMA_VERSION}: it was written by a newer gradloc. Upgrade gradloc, or point "
            "--db / GRADLOC_DB at another file.")
    return version


def _create(conn: sqlite3.Connection, path: str) -> None:
    tables = conn.execute("SELECT count(*) FROM sqlite_schema WHERE type = 'table'").fetchone()[0]
    if tables:  # user_version 0 but tables: someone else's database, not ours to alter
        raise StoreError(f"{path} is a SQLite database without an incident-store schema version; "
                         "refusing to add tables to it")
    for statement in _SCHEMA_V1.split(";"):
        if statement.strip():
            conn.execute(statement)
    inbox.create(conn)
    outliers.create(conn)
    aliases.create(conn)
    quarantine.create(conn)
    _groups_and_span_provenance(conn)


def check_path(path: str | os.PathLike[str]) -> str:
    """The path as a string; in-memory databases are refused (each pooled connection would get its own)."""
    text = os.fspath(path)
    if text in ("", ":memory:") or text.startswith("file::memory:"):
        raise StoreError("the incident store needs a file path, not an in-memory database")
    return text
