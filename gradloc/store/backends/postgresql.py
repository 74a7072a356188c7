"""The incident store on PostgreSQL: many daemons on many machines writing one database.

**Writers.** Every write transaction takes one transaction-scoped advisory lock
(``pg_advisory_xact_lock(WRITE_LOCK)``) after ``BEGIN``, at PostgreSQL's default READ COMMITTED
isolation: writers are serialised across processes and machines exactly as SQLite's ``BEGIN IMMEDIATE``
serialises them, and the store's read-then-write steps (an inbox row new or re-sent, a replaced
incident's delete-and-insert, retention's counts around cascaded deletes, a claim of a dead owner's
rows) see no other writer between their statements. The alternative, SERIALIZABLE with retries on
serialisation failures, would let writes of unrelated jobs overlap, at the price of a retry loop
around every transaction and a second behaviour to test; the store's transactions take milliseconds,
so one writer at a time costs little. The lock goes with the transaction: a daemon killed mid-write
(its connection closes) or stalled past ``idle_in_transaction_session_timeout`` releases it.
Readers take no lock: each statement sees committed data only.

**Schema.** The version lives in a one-row table ``gradloc_schema``; creation and migration run in one
write transaction (DDL is transactional in PostgreSQL), so two daemons starting on an empty database
create the schema once and a failed migration leaves the old one.

**Failures.** Connecting has a timeout; the connection's keepalives notice a vanished server; a
pooled connection idle for a while is checked before it is lent again; a failed statement raises
(psycopg's error) and the caller counts it, as with SQLite. Nothing retries in a loop here.

psycopg (3) is imported only when a ``postgresql://`` URL is opened: ``pip install 'gradloc[postgres]'``.
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Sequence
from typing import Any, cast
from urllib.parse import unquote, urlsplit, urlunsplit

from gradloc.store.backends.base import BUSY_TIMEOUT_MS, Backend, Connection, Cursor
from gradloc.store.backends.pg_sql import adapt, translate
from gradloc.store.errors import StoreError

SCHEMES = ("postgresql", "postgres")
WRITE_LOCK = 0x6772_6164_6C6F_6301  # "gradloc\x01": the advisory lock key every writer of one database takes
PING_AFTER_S = 10.0  # a pooled connection idle longer than this is checked before it is lent again
IDLE_IN_TRANSACTION_MS = 60_000  # a stalled writer's session is ended by the server, releasing the lock
_PASSWORD_PARAM = re.compile(r"((?:^|&)password=)[^&]*")
_CONNECT_DEFAULTS = {"connect_timeout": "5", "application_name": "gradloc", "keepalives_idle": "30",
                     "keepalives_interval": "10", "keepalives_count": "3", "tcp_user_timeout": "60000"}


def is_url(target: object) -> bool:
    """Whether ``target`` names a PostgreSQL database (``postgresql://`` or ``postgres://``), not a file."""
    return isinstance(target, str) and target.split("://", 1)[0].lower() in SCHEMES and "://" in target


def redact(target: object) -> str:
    """``target`` as messages and logs may show it: a URL's password (``user:password@`` or a ``password=``
    parameter) replaced by ``***``."""
    text = str(target)
    if not is_url(text):
        return text
    parts = urlsplit(text)
    if parts.password is not None:
        user, _, host = parts.netloc.rpartition("@")
        parts = parts._replace(netloc=f"{user.split(':', 1)[0]}:***@{host}")
    return urlunsplit(parts._replace(query=_PASSWORD_PARAM.sub(r"\1***", parts.query)))


def _passwords(url: str) -> list[str]:
    """Every spelling of the URL's password a driver message could quote (as written, and decoded)."""
    parts = urlsplit(url)
    found = [parts.password or ""] + [m[1] for m in re.finditer(r"(?:^|&)password=([^&]*)", parts.query)]
    return sorted({p for raw in found if raw for p in (raw, unquote(raw))}, key=len, reverse=True)


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError as exc:
        raise StoreError("a postgresql:// incident store needs psycopg 3: pip install 'gradloc[postgres]' "
                         f"(or scripts/setup.sh) [{exc}]") from None
    return psycopg


class PgConnection:
    """A psycopg connection (autocommit; transactions explicit) speaking the store's SQL (backends/pg_sql.py)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    @property
    def in_transaction(self) -> bool:
        return bool(self.raw.info.transaction_status != 0)  # 0: IDLE

    def execute(self, sql: str, parameters: Sequence[Any] = (), /) -> Cursor:
        cur = self.raw.cursor()
        cur.execute(translate(sql, bool(parameters)), adapt(parameters) if parameters else None)
        return cast(Cursor, cur)

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Cursor:
        cur = self.raw.cursor()
        cur.executemany(translate(sql, True), [adapt(p) for p in parameters])
        return cast(Cursor, cur)

    def rollback(self) -> None:
        self.raw.execute("ROLLBACK")

    def close(self) -> None:
        self.raw.close()


class PostgresBackend(Backend):
    dialect = "postgresql"
    shared = True

    def __init__(self, url: str) -> None:
        super().__init__(redact(url))
        self._psycopg = _psycopg()
        self.errors = (self._psycopg.Error,)
        self._passwords = _passwords(url)
        try:
            params = self._psycopg.conninfo.conninfo_to_dict(url)
        except self._psycopg.Error as exc:
            raise StoreError(f"{self.target}: not a PostgreSQL URL ({self._scrub(exc)})") from None
        self._params = {**_CONNECT_DEFAULTS, **params}

    def _scrub(self, exc: BaseException) -> str:
        text = str(exc).strip()
        for password in self._passwords:
            text = text.replace(password, "***")
        return text

    def connect(self) -> Connection:
        try:
            raw = self._psycopg.connect(**self._params, autocommit=True)
        except self._psycopg.Error as exc:  # from None: the driver's own text may quote the URL
            raise StoreError(f"cannot connect to the incident store {self.target}: {self._scrub(exc)}") from None
        try:
            raw.execute(f"SET lock_timeout = {BUSY_TIMEOUT_MS}; "
                        f"SET idle_in_transaction_session_timeout = {IDLE_IN_TRANSACTION_MS}")
        except self._psycopg.Error:
            raw.close()
            raise
        return cast(Connection, PgConnection(raw))

    def begin_write(self, conn: Connection) -> None:
        conn.execute("BEGIN")
        try:
            conn.execute("SELECT pg_advisory_xact_lock(?)", (WRITE_LOCK,))
        except BaseException:
            with contextlib.suppress(Exception):
                conn.execute("ROLLBACK")
            raise

    def version(self, conn: Connection) -> int:
        # Not to_regclass(): it reads the session's catalog cache, which a wait on an advisory lock does not
        # refresh, so a daemon that waited for another's schema creation would not see the table it made.
        # A query on pg_tables reads the catalog with the statement's snapshot.
        if not conn.execute("SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = current_schema() "
                            "AND tablename = 'gradloc_schema'").fetchone()[0]:
            return 0
        row = conn.execute("SELECT max(version) FROM gradloc_schema").fetchone()
        return int(row[0] or 0)

    def set_version(self, conn: Connection, version: int) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS gradloc_schema (version INTEGER NOT NULL)")
        conn.execute("DELETE FROM gradloc_schema")
        conn.execute("INSERT INTO gradloc_schema (version) VALUES (?)", (int(version),))

    def has_tables(self, conn: Connection) -> bool:
        return bool(conn.execute("SELECT count(*) FROM information_schema.tables "
                                 "WHERE table_schema = current_schema()").fetchone()[0])

    def transient(self, exc: BaseException) -> bool:
        # OperationalError: the connection broke, the lock wait timed out, the server is shutting down;
        # a plain StoreError: connect() could not reach it
        return isinstance(exc, self._psycopg.OperationalError) or type(exc) is StoreError

    def healthy(self, conn: Connection, idle_s: float) -> bool:
        raw = cast(PgConnection, conn).raw
        if raw.closed or raw.broken:
            return False
        if idle_s > PING_AFTER_S:
            try:
                raw.execute("SELECT 1")
            except self._psycopg.Error:
                return False
        return True
