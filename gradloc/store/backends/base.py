"""What the incident store asks of a database, and the connection pool both backends share.

The store's SQL (``gradloc/store/*.py``) is written once: ``?`` placeholders, SQLite's type names in DDL,
``ON CONFLICT`` upserts — the subset both SQLite and PostgreSQL run (docs/incident-store.md, "Writing a
store module"). What does differ between the two databases (how a connection opens, how a writer
excludes the others, where the schema version lives, what a placeholder or a type is called on the
wire) is a :class:`Backend`, one class per database, and nothing else in the store knows which one it
talks to.
"""
from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

from gradloc.store.errors import StoreError

BUSY_TIMEOUT_MS = 5000  # how long a writer waits for another process's write transaction, on either database


class Cursor(Protocol):
    rowcount: int

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """The part of ``sqlite3.Connection`` the store modules use; the PostgreSQL backend wraps psycopg's in it."""

    @property
    def in_transaction(self) -> bool: ...

    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Cursor: ...

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Cursor: ...

    def rollback(self) -> None: ...

    def close(self) -> None: ...


class Backend(ABC):
    """One database's way of doing what the store needs. ``target`` is what messages name: the file's
    path, or the URL without its password."""

    dialect: ClassVar[str]
    shared: ClassVar[bool]  # written by many processes on many machines at once (not one daemon per file)
    errors: tuple[type[BaseException], ...]  # what the driver raises for a failed statement

    def __init__(self, target: str) -> None:
        self.target = target

    @abstractmethod
    def connect(self) -> Connection:
        """A new connection in autocommit mode (the store begins and commits explicitly); StoreError when the
        database cannot be opened."""

    @abstractmethod
    def begin_write(self, conn: Connection) -> None:
        """Begin a write transaction that no other writer, in this process or another, interleaves with."""

    @abstractmethod
    def version(self, conn: Connection) -> int:
        """The stored schema version; 0 for a database gradloc has not written yet."""

    @abstractmethod
    def set_version(self, conn: Connection, version: int) -> None:
        """Record ``version`` (inside the schema transaction)."""

    @abstractmethod
    def has_tables(self, conn: Connection) -> bool:
        """Whether the database (its current schema) holds any table: version 0 with tables is not ours."""

    def transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the database cannot be reached or is busy now (the same call may succeed
        later), rather than that the call itself is wrong."""
        return False

    def healthy(self, conn: Connection, idle_s: float) -> bool:
        """Whether a pooled connection, idle for ``idle_s``, may be lent again (a server can drop one)."""
        return True


class Pool:
    """Idle connections to one database; a thread borrows one per operation and gives it back.

    The daemon writes from one thread while its HTTP handlers read from others, each request possibly
    on a new thread: a pool, not ``threading.local``, whose connections would pile up with short-lived
    handler threads. A connection that fails its backend's health check is closed, never lent again.
    """

    def __init__(self, backend: Backend, size: int = 4) -> None:
        self._backend, self._size = backend, size
        self._idle: list[tuple[Connection, float]] = []
        self._lock = threading.Lock()
        self._closed = False

    @contextlib.contextmanager
    def connection(self) -> Iterator[Connection]:
        conn = self._borrow()
        try:
            yield conn
        finally:
            self._give_back(conn)

    def _borrow(self) -> Connection:
        while True:
            with self._lock:
                if self._closed:
                    raise StoreError(f"the incident store {self._backend.target} is closed")
                if not self._idle:
                    break
                conn, since = self._idle.pop()
            if self._backend.healthy(conn, time.monotonic() - since):
                return conn
            _close(conn)
        return self._backend.connect()

    def _give_back(self, conn: Connection) -> None:
        try:
            if conn.in_transaction:  # only after a failed COMMIT/ROLLBACK: never lend a dirty connection
                conn.rollback()
            keep = self._backend.healthy(conn, 0.0)
        except Exception:  # noqa: BLE001 - a connection that cannot even roll back is not lent again
            keep = False
        with self._lock:
            if keep and not self._closed and len(self._idle) < self._size:
                self._idle.append((conn, time.monotonic()))
                return
        _close(conn)

    def close(self) -> None:
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for conn, _ in idle:
            _close(conn)


def _close(conn: Connection) -> None:
    with contextlib.suppress(Exception):
        conn.close()
