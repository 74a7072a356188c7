"""The incident store on SQLite: one file, WAL mode, one daemon writing it (the embedded default).

Writers are serialised by ``BEGIN IMMEDIATE`` (SQLite admits one writer at a time; waiting on its lock
beats failing with SQLITE_BUSY), and WAL lets readers proceed during a write and see only committed
incidents, never half of one. The schema version lives in ``PRAGMA user_version``.
"""
from __future__ import annotations

import os
import sqlite3
from typing import Any, cast

from gradloc.store.backends.base import BUSY_TIMEOUT_MS, Backend, Connection
from gradloc.store.errors import StoreError


class SQLiteBackend(Backend):
    dialect = "sqlite"
    shared = False
    errors = (sqlite3.Error,)

    def __init__(self, path: str | os.PathLike[str], create: bool) -> None:
        text = check_path(path)
        super().__init__(text)
        if not os.path.exists(text):
            if not create:
                raise StoreError(f"no incident store at {text}")
            os.makedirs(os.path.dirname(os.path.abspath(text)), exist_ok=True)

    def connect(self) -> Connection:
        """Autocommit (transactions are explicit), WAL, foreign keys on.

        ``synchronous=NORMAL`` is safe in WAL (a power cut can lose the last commits, never corrupt the
        file) and keeps commits cheap.
        """
        path = self.target
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
        return cast(Connection, conn)

    def begin_write(self, conn: Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")  # the write lock now, not at the first write (no deadlock on upgrade)

    def version(self, conn: Connection) -> int:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])

    def set_version(self, conn: Connection, version: int) -> None:
        conn.execute(f"PRAGMA user_version = {int(version)}")

    def transient(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.OperationalError)  # locked past busy_timeout, disk full, I/O error

    def has_tables(self, conn: Connection) -> bool:
        return bool(conn.execute("SELECT count(*) FROM sqlite_schema WHERE type = 'table'").fetchone()[0])


def check_path(path: Any) -> str:
    """The path as a string; in-memory databases are refused (each pooled connection would get its own)."""
    text = os.fspath(path)
    if text in ("", ":memory:") or text.startswith("file::memory:"):
        raise StoreError("the incident store needs a file path, not an in-memory database")
    return text
