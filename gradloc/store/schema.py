"""The incident store's schema, for both databases, and how it is created and upgraded.

The schema version lives where the backend keeps it (SQLite: ``PRAGMA user_version``; PostgreSQL: the
``gradloc_schema`` table; 0 = a fresh database). A database written by a
newer gradloc is refused rather than read: a newer schema may have moved meaning between columns,
and a daemon that "mostly works" on it would write rows the newer reader misreads. Older versions
are upgraded in place by the steps in ``_MIGRATIONS`` (1 → 2 adds the inbox, 2 → 3 the
``sample_outliers`` table of per-sample findings, gradloc/store/outliers.py, 3 → 4 the
``finding_ids`` of each incident's rank findings, gradloc/store/aliases.py, 4 → 5 the outliers' provenance
columns, 5 → 6 the quarantine, gradloc/store/quarantine.py, 6 → 7 the per-step data groups,
gradloc/store/groups.py, and the spans' source and origin, gradloc/store/history.py, 7 → 8 the drift detector's
``precursor_findings``, gradloc/store/precursor_findings.py). The DDL and the
migrations are written in the SQL both databases run (gradloc/store/backends/pg_sql.py translates the rest);
PostgreSQL support began at version 6, so the steps below it only ever run on SQLite files (4 → 5 reads ``PRAGMA
table_info``). How a module adds a table or a migration: docs/incident-store.md, "Writing a store module".
"""
from __future__ import annotations

from collections.abc import Callable

from gradloc.store import aliases, groups, history, inbox, outliers, precursor_findings, quarantine
from gradloc.store.backends import Backend, Connection
from gradloc.store.errors import SchemaVersionError, StoreError

SCHEMA_VERSION = 8  # 2: the inbox (gradloc/store/inbox.py); 3: sample_outliers (gradloc/store/outliers.py);
# 4: finding_ids (gradloc/store/aliases.py); 5: the outliers' provenance (source, origin, info); 6: the quarantine
# (gradloc/store/quarantine.py); 7: step_groups (gradloc/store/groups.py) and the spans' source and origin
# (gradloc/store/history.py); 8: precursor_findings (gradloc/store/precursor_findings.py)

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

def _groups_and_span_provenance(conn: Connection) -> None:
    groups.create(conn)
    history.add_span_provenance(conn)


_MIGRATIONS: dict[int, Callable[[Connection], None]] = {1: inbox.create, 2: outliers.create,
                                                                3: aliases.create,
                                                                4: outliers.add_provenance,
                                                                5: quarantine.create,
                                                                6: _groups_and_span_provenance,
                                                                7: precursor_findings.create}  # v -> v + 1


def ensure_schema(conn: Connection, backend: Backend, create: bool = True) -> None:
    """Create the schema in a fresh database, upgrade an older one, refuse a newer one.

    The usual case (already current) only reads, so a CLI reader never takes the write lock and
    works on a database it may not write. The rest runs in one write transaction (the backend's writer
    lock): two processes opening a fresh database at once create the schema once; the second sees the
    first's version when it gets the lock. ``create=False`` refuses a database without a schema (the
    CLI: a wrong ``--db`` should say so, not show an empty store).
    """
    version = check_version(conn, backend)
    if version == SCHEMA_VERSION:
        return
    if version == 0 and not create:
        raise StoreError(f"no incident store in {backend.target} (the agent creates it)")
    backend.begin_write(conn)
    try:
        version = check_version(conn, backend)
        if version == 0:
            _create(conn, backend)
        while 0 < version < SCHEMA_VERSION:
            _MIGRATIONS[version](conn)
            version += 1
        backend.set_version(conn, SCHEMA_VERSION)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def check_version(conn: Connection, backend: Backend) -> int:
    """The stored schema version; :class:`SchemaVersionError` when a newer gradloc wrote it."""
    version = backend.version(conn)
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{backend.target} has incident-store schema version {version}, but this gradloc reads versions up "
            f"to {SCHEMA_VERSION}: it was written by a newer gradloc. Upgrade gradloc, or point "
            "--db / GRADLOC_DB at another store.")
    return version


def _create(conn: Connection, backend: Backend) -> None:
    if backend.has_tables(conn):  # version 0 but tables: someone else's database, not ours to alter
        raise StoreError(f"{backend.target} is a {backend.dialect} database without an incident-store schema "
                         "version; refusing to add tables to it (give gradloc a database of its own)")
    for statement in _SCHEMA_V1.split(";"):
        if statement.strip():
            conn.execute(statement)
    inbox.create(conn)
    outliers.create(conn)
    aliases.create(conn)
    quarantine.create(conn)
    _groups_and_span_provenance(conn)
    precursor_findings.create(conn)
