"""The incident store: correlated incidents and per-step summaries, in SQLite or PostgreSQL.

``IncidentStore(path)`` keeps them in one SQLite file (WAL mode; the embedded default), and
``IncidentStore("postgresql://…")`` in a PostgreSQL database that many daemons on many machines write at
once. The class and its SQL are the same for both (the module keeps its first name: every caller imports
the store from here); what differs between the databases is a backend (gradloc/store/backends).

Connections come from a small pool (any thread borrows one for one operation). Writes take a lock in
this process first (waiting on our own lock beats spinning on the database's), then the backend's
writer lock, which excludes writers in other processes too. Readers see only committed incidents,
never half of one. Schema and migrations: :mod:`gradloc.store.schema`; the layout is documented in
``docs/incident-store.md``.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Self

from gradloc.errors import ConfigError
from gradloc.records import PrecursorFinding, SampleOutlier
from gradloc.reports import CorrelatedIncident, StepSummary
from gradloc.store import aliases as _aliases
from gradloc.store import groups as _groups
from gradloc.store import history as _history
from gradloc.store import inbox as _inbox
from gradloc.store import outliers as _outliers
from gradloc.store import precursor_findings as _precursor_findings
from gradloc.store import retention as _retention
from gradloc.store.backends import Connection, Pool, as_target, open_backend
from gradloc.store.errors import AmbiguousIdError
from gradloc.store.incident_json import correlated_from_dict
from gradloc.store.quarantine import Quarantine
from gradloc.store.retention import RetentionConfig
from gradloc.store.rows import (
    INCIDENT_COLUMNS,
    IncidentRow,
    StepRow,
    incident_params,
    incident_row,
    span_params,
    step_params,
    step_row,
    where,
)
from gradloc.store.schema import check_version, ensure_schema

_INSERT_INCIDENT = f"INSERT INTO incidents ({INCIDENT_COLUMNS}, json) VALUES ({', '.join('?' * 12)})"
_INSERT_SPAN = ('INSERT INTO spans (incident_id, idx, rank, micro_batch, sample, start, "end", share, text, '
                f"token_ids, sample_id, source, origin) VALUES ({', '.join('?' * 13)})")
_STEP_COLUMNS = "job, rank, step, time_unix, global_norm, loss, top_share, unattributed_share, nonfinite, skipped"
_INSERT_STEP = (f"INSERT INTO steps ({_STEP_COLUMNS}) VALUES ({', '.join('?' * 10)}) ON CONFLICT (job, step, rank) "
                "DO UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in _STEP_COLUMNS.split(", ")[3:]))
_MAX_CODEPOINT = "\U0010ffff"  # sorts after every character: [p, p + this) is the range of ids starting with p


def default_db_path() -> Path | str:
    """``$GRADLOC_DB`` (a ``postgresql://`` URL stays a string), else
    ``${XDG_STATE_HOME:-~/.local/state}/gradloc/incidents.db``.

    Incidents are state (history worth keeping across restarts, not cache, not config), hence
    XDG_STATE_HOME; per the XDG spec a relative XDG_STATE_HOME is ignored.
    """
    env = os.environ.get("GRADLOC_DB")
    if env:
        return as_target(env)
    state = os.environ.get("XDG_STATE_HOME", "")
    base = Path(state) if state and os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "gradloc" / "incidents.db"


class IncidentStore:
    """Correlated incidents, their culprit spans and per-step summaries: in the SQLite file at ``path``, or
    in the PostgreSQL database a ``postgresql://user@host:port/db`` URL names.

    ``create=False`` refuses to create a missing file or an empty database's schema (the CLI: a typo in
    ``--db`` should say so, not show an empty store). ``path`` is what messages name (a URL without its
    password); ``shared``: many processes may write this store at once (PostgreSQL).
    """

    def __init__(self, path: str | os.PathLike[str], retention: RetentionConfig | None = None,
                 *, create: bool = True) -> None:
        retention = RetentionConfig() if retention is None else retention
        if not isinstance(retention, RetentionConfig):
            raise ConfigError(f"retention must be a RetentionConfig, got {type(retention).__name__}")
        self._backend = open_backend(path, create)
        self.path, self.shared, self.retention = self._backend.target, self._backend.shared, retention
        self._pool = Pool(self._backend)
        self._write_lock = threading.Lock()
        try:
            with self._pool.connection() as conn:
                ensure_schema(conn, self._backend, create)
        except BaseException:
            self._pool.close()
            raise
        self.quarantine = Quarantine(self._transaction, self._pool.connection)  # samples kept out of the next run
        self.history = _history.History(self._pool.connection)  # earlier flags, data groups: memory across runs

    # -- writing -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Connection]:
        """One write transaction: everything inside commits together or not at all. The schema version is
        read again under the lock: on a shared database a newer gradloc may have upgraded it meanwhile,
        and this one must not write rows the newer schema would misread."""
        with self._write_lock, self._pool.connection() as conn:
            self._backend.begin_write(conn)
            try:
                check_version(conn, self._backend)
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def put_incident(self, inc: CorrelatedIncident, inbox_keys: Sequence[_inbox.Key] = ()) -> None:
        """Store ``inc`` with its spans, replacing an incident with the same id (the correlator
        re-emits an incident when a straggler rank reports late), map the ids of its rank findings
        to it (gradloc/store/aliases.py), and mark the inbox rows it holds done. All or nothing."""
        params = incident_params(inc)
        with self._transaction() as conn:
            conn.execute("DELETE FROM incidents WHERE incident_id = ?", (inc.incident_id,))
            conn.execute(_INSERT_INCIDENT, params)
            conn.executemany(_INSERT_SPAN, span_params(inc))
            _aliases.put(conn, inc.incident_id, (f.incident_id for f in inc.findings))
            _inbox.mark_done(conn, inbox_keys)

    def inbox_put(self, client_id: str, sequence: int, who: tuple[str, int, int],
                  payloads: Sequence[tuple[int, str]], owner: str = "daemon") -> list[int]:
        """Commit a batch's rank incidents ((position in the batch, JSON) each; ``who``: job, rank, world
        size) before it is acknowledged; returns the positions that were new (none for a re-sent
        batch). See gradloc/store/inbox.py."""
        with self._transaction() as conn:
            return _inbox.put(conn, (client_id, sequence), who, payloads, time.time(), owner)

    def inbox_pending(self, owner: str = "daemon") -> list[tuple[_inbox.Key, tuple[str, int, int], str]]:
        """``owner``'s inbox rows no stored incident holds yet (to correlate again after a restart)."""
        with self._pool.connection() as conn:
            return _inbox.pending(conn, owner)

    def inbox_forget(self, keys: Sequence[_inbox.Key]) -> None:
        """Delete inbox rows the agent did not take after all (its queue was full: the client retries)."""
        with self._transaction() as conn:
            conn.executemany("DELETE FROM inbox WHERE client_id = ? AND sequence = ? AND idx = ? AND done = 0", keys)

    def inbox_claim(self, me: str, prefix: str, dead: Any) -> int:
        """Take over the open inbox rows of gone owners starting with ``prefix`` (gradloc/store/inbox.py)."""
        with self._transaction() as conn:
            return _inbox.claim(conn, me, prefix, dead)

    def put_steps(self, steps: Sequence[StepSummary]) -> int:
        """Store step summaries in one transaction (a step already stored for its (job, rank) is
        replaced: a job resumed from a checkpoint re-runs steps). Returns the rows written."""
        if not steps:
            return 0
        with self._transaction() as conn:
            _outliers.put(conn, steps)  # their per-sample findings, in the same transaction
            _precursor_findings.put(conn, steps)  # and their drift findings
            _groups.put(conn, steps)  # and their per-group data counts
            return conn.executemany(_INSERT_STEP, step_params(steps)).rowcount

    def apply_retention(self, now: float | None = None) -> dict[str, int]:
        """Delete what :class:`RetentionConfig` no longer keeps; returns the counts per rule
        (``incidents_by_age``, ``incidents_by_count``, ``spans``, ``steps_by_age``, ``steps_by_count``)."""
        now = time.time() if now is None else now
        with self._transaction() as conn:
            counts = _retention.apply(conn, self.retention, now)
            counts["inbox"] = _inbox.prune(conn, now)
            counts["sample_outliers"] = _outliers.prune(conn, self.retention.max_age_days, now)
            counts["precursor_findings"] = _precursor_findings.prune(conn, self.retention.max_age_days, now)
            counts["step_groups"] = _groups.prune(conn, self.retention.max_age_days, now)
            return counts

    # -- reading -----------------------------------------------------------------------------

    def list_incidents(self, job: str | None = None, limit: int | None = 50,
                       since_unix: float | None = None) -> list[IncidentRow]:
        """Headline rows, newest first; ``limit=None`` for all."""
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit}")
        where, args = _filters(job, since_unix)
        sql = f"SELECT {INCIDENT_COLUMNS} FROM incidents{where} ORDER BY time_unix DESC, incident_id DESC"
        if limit is not None:
            sql, args = sql + " LIMIT ?", [*args, limit]
        with self._pool.connection() as conn:
            return [incident_row(r) for r in conn.execute(sql, args)]

    def get_incident_json(self, id_or_prefix: str) -> str | None:
        """The stored JSON text of one incident (what ``/api/incidents/<id>`` serves), by full id or
        unique prefix of its own id or of one of its rank findings' ids (what the training process
        printed: gradloc/store/aliases.py); None when nothing matches, :class:`AmbiguousIdError`
        when several incidents do."""
        key = id_or_prefix.strip()
        if not key:
            raise ValueError("an incident id (or a prefix of one) is required")
        with self._pool.connection() as conn:
            ids = _aliases.resolve(conn, key, key + _MAX_CODEPOINT)
            if len(ids) > 1:
                raise AmbiguousIdError(key, ids)
            if not ids:
                return None
            return conn.execute("SELECT json FROM incidents WHERE incident_id = ?", ids).fetchone()[0]

    def incident_id_of_trace(self, trace_id: str) -> str | None:
        """The id of the incident whose trace id is ``trace_id`` (what exemplars carry), or None."""
        with self._pool.connection() as conn:
            row = conn.execute("SELECT incident_id FROM incidents WHERE trace_id = ? LIMIT 1", (trace_id,)).fetchone()
        return None if row is None else row[0]

    def incident_id_at(self, job: str, step: int) -> str | None:
        """The id of job ``job``'s incident at step ``step`` (the earliest stored), or None: what a
        new-cause incident's ``follows`` names."""
        with self._pool.connection() as conn:
            row = conn.execute("SELECT incident_id FROM incidents WHERE job = ? AND step = ? "
                               "ORDER BY time_unix, incident_id LIMIT 1", (job, step)).fetchone()
        return None if row is None else row[0]

    def get_incident(self, id_or_prefix: str) -> CorrelatedIncident | None:
        """One incident by full id or unique prefix (see :meth:`get_incident_json`)."""
        text = self.get_incident_json(id_or_prefix)
        return None if text is None else correlated_from_dict(json.loads(text))

    def iter_incidents(self, job: str | None = None, since_unix: float | None = None,
                       batch: int = 256) -> Iterator[CorrelatedIncident]:
        """Every matching incident, oldest first, fetched ``batch`` at a time.

        A connection is held per batch, not for the whole iteration, so a slow consumer (an export
        piped to a slow disk) never pins a pool connection or a WAL snapshot.
        """
        where, args = _filters(job, since_unix)
        after: tuple[float, str] | None = None
        while True:
            cond, page_args = where, list(args)
            if after is not None:
                cond += (" AND " if cond else " WHERE ") + "(time_unix, incident_id) > (?, ?)"
                page_args += after
            sql = f"SELECT time_unix, incident_id, json FROM incidents{cond} ORDER BY time_unix, incident_id LIMIT ?"
            with self._pool.connection() as conn:
                rows = conn.execute(sql, (*page_args, batch)).fetchall()
            for _, _, text in rows:
                yield correlated_from_dict(json.loads(text))
            if len(rows) < batch:
                return
            after = (rows[-1][0], rows[-1][1])

    def list_outliers(self, job: str | None = None, kind: str | None = None, since_unix: float | None = None,
                      limit: int | None = 50) -> list[SampleOutlier]:
        """Per-sample findings (``sample_outliers``), newest first; ``limit=None`` for all."""
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit}")
        with self._pool.connection() as conn:
            return _outliers.select(conn, job, kind, since_unix, limit)

    def list_precursor_findings(self, job: str | None = None, statistic: str | None = None, pages: bool | None = None,
                                since_unix: float | None = None, limit: int | None = 50, *,
                                steps: tuple[int, int] | None = None) -> list[PrecursorFinding]:
        """The drift detector's findings (``precursor_findings``), newest first; ``pages=True``: only the paging ones;
        ``steps``: only those of steps first..last (inclusive); ``limit=None`` for all."""
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit}")
        with self._pool.connection() as conn:
            return _precursor_findings.select(conn, job, statistic, pages, since_unix, limit, steps)

    def step_summaries(self, job: str, rank: int | None = None, last: int = 1000) -> list[StepRow]:
        """The ``last`` most recent steps of ``job`` (all ranks, or one), in step then rank order."""
        if last < 1:
            raise ValueError(f"last must be >= 1, got {last}")
        if rank is None:
            sql = (f"SELECT {_STEP_COLUMNS} FROM steps WHERE job = ? AND step IN (SELECT DISTINCT step "
                   "FROM steps WHERE job = ? ORDER BY step DESC LIMIT ?) ORDER BY step, rank")
            args: tuple[Any, ...] = (job, job, last)
        else:
            sql = (f"SELECT * FROM (SELECT {_STEP_COLUMNS} FROM steps WHERE job = ? AND rank = ? "
                   "ORDER BY step DESC LIMIT ?) AS latest ORDER BY step")
            args = (job, rank, last)
        with self._pool.connection() as conn:
            return [step_row(r) for r in conn.execute(sql, args)]

    def step_range(self, job: str, rank: int, first: int, last: int) -> list[StepRow]:
        """The steps ``first``..``last`` (inclusive) of one rank of ``job`` that the store holds, in step order."""
        sql = f"SELECT {_STEP_COLUMNS} FROM steps WHERE job = ? AND rank = ? AND step BETWEEN ? AND ? ORDER BY step"
        with self._pool.connection() as conn:
            return [step_row(r) for r in conn.execute(sql, (job, rank, first, last))]

    # -- lifetime ----------------------------------------------------------------------------

    def unavailable(self, exc: BaseException) -> bool:
        """Whether a call failed with ``exc`` because the database cannot be reached or is busy now (the
        same call may succeed later: the daemon tells a client to resend) rather than because of the call."""
        return self._backend.transient(exc)

    def close(self) -> None:
        """Close the pooled connections; any later call raises :class:`StoreError`."""
        self._pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _filters(job: str | None, since_unix: float | None) -> tuple[str, list[Any]]:
    return where(("job = ?", job), ("time_unix >= ?", since_unix))
