"""The incident store's databases: SQLite (a file path, the embedded default) and PostgreSQL (a
``postgresql://`` URL). :func:`open_backend` picks one by the target's spelling; the store itself never
asks which it got (see :mod:`gradloc.store.backends.base`)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from gradloc.store.backends.base import Backend, Connection, Pool
from gradloc.store.backends.postgresql import PostgresBackend, is_url, redact
from gradloc.store.backends.sqlite import SQLiteBackend


def open_backend(target: str | os.PathLike[str], create: bool) -> Backend:
    """A PostgreSQL backend for a ``postgresql://`` URL, else SQLite on the file at ``target``."""
    return PostgresBackend(str(target)) if is_url(target) else SQLiteBackend(target, create)


def as_target(text: str) -> str | Path:
    """A ``--db``/``$GRADLOC_DB`` value as the store opens it: a URL stays a string (a Path would fold its
    ``//``), anything else is a file path (``~`` expanded)."""
    return text if is_url(text) else Path(text).expanduser()


def database_errors() -> tuple[type[BaseException], ...]:
    """The drivers' error classes loaded so far (what a failed store call may raise), without importing one."""
    import sqlite3

    psycopg = sys.modules.get("psycopg")
    return (sqlite3.Error, psycopg.Error) if psycopg is not None else (sqlite3.Error,)


__all__ = ["Backend", "Connection", "Pool", "as_target", "database_errors", "is_url", "open_backend", "redact"]
