"""A real PostgreSQL server for the tests: Debian's ``postgresql`` 15 (scripts/setup.sh installs it), one per
test session, started on a free port in a temp dir, every test given a fresh database of its own.

As root (CI, these machines) the server runs as the ``postgres`` user through ``runuser`` (``initdb`` refuses
root; DESIGN.md §9); as anyone else, directly. It listens on 127.0.0.1 and a socket in its own dir, trusts
local connections (user ``gradloc``), and skips fsync (a test database need not survive a power cut; the
durability tests kill the daemon, never the server). It is stopped when the session ends, and a detached
watchdog stops it (and removes its dir) if the test process itself is killed: a test run never leaves a
server behind.

Missing binaries fail the test that needs them with the set-up command (a silently skipped tier is a
feature nobody checks).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gradloc.demo.spawn import free_port

PG_BIN = Path(os.environ.get("GRADLOC_PG_BIN", "/usr/lib/postgresql/15/bin"))
USER = "gradloc"
SETTINGS = "-c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off -c max_connections=200"


def require_binaries() -> Path:
    """The server's binaries, or a test failure that says how to install them."""
    missing = [n for n in ("initdb", "pg_ctl", "postgres") if not os.access(PG_BIN / n, os.X_OK)]
    if missing:
        pytest.fail(f"PostgreSQL 15 binaries missing in {PG_BIN} ({', '.join(missing)}): run scripts/setup.sh "
                    "(installs Debian's postgresql) or set GRADLOC_PG_BIN", pytrace=False)
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.fail("psycopg is missing: run scripts/setup.sh (installs gradloc's postgres extra)", pytrace=False)
    return PG_BIN


class PgServer:
    """One server in ``root`` (``data/``, ``log``, its socket); :meth:`database` makes an empty database."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, 0
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self._n = 0
        self._watchdog: subprocess.Popen[bytes] | None = None

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self._as, *args], capture_output=True, text=True, timeout=timeout)

    def start(self) -> PgServer:
        if self._as:
            shutil.chown(self.root, "postgres")
        out = self._run(str(PG_BIN / "initdb"), "-D", str(self.root / "data"), "-A", "trust", "-U", USER, "-N",
                        "-E", "UTF8")
        if out.returncode:
            raise RuntimeError(f"initdb failed:\n{out.stdout}{out.stderr}")
        for _ in range(3):  # a free port can be taken between choosing and binding it: try another
            self.port = free_port()
            out = self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.root / "data"), "-l", str(self.root / "log"),
                            "-w", "-t", "60", "-o", f"-p {self.port} -k {self.root} {SETTINGS}", "start")
            if out.returncode == 0:
                self._watch()
                return self
        raise RuntimeError(f"the PostgreSQL server did not start:\n{out.stdout}{out.stderr}\n{self.log()}")

    def _watch(self) -> None:
        """A detached shell that stops the server and removes its dir once this process is gone (killed: no
        fixture teardown)."""
        stop = f"{' '.join(self._as)} {PG_BIN / 'pg_ctl'} -D {self.root / 'data'} -w stop -m immediate"
        self._watchdog = subprocess.Popen(
            ["sh", "-c", f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 2; done; {stop}; rm -rf {self.root}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def stop(self) -> None:
        data = str(self.root / "data")
        if self._run(str(PG_BIN / "pg_ctl"), "-D", data, "-w", "-t", "30", "stop", "-m", "fast").returncode:
            self._run(str(PG_BIN / "pg_ctl"), "-D", data, "-w", "stop", "-m", "immediate")
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait(10)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.root / "log").read_text(errors="replace")[-4000:]
        return ""

    def url(self, database: str, password: str | None = None) -> str:
        auth = USER if password is None else f"{USER}:{password}"
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"

    def admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(sql)

    def database(self) -> str:
        """A new empty database's name."""
        self._n += 1
        name = f"t{self._n}"
        self.admin(f"CREATE DATABASE {name}")
        return name


@contextlib.contextmanager
def running_server() -> Iterator[PgServer]:
    """A started server, stopped and removed afterwards whatever happened."""
    require_binaries()
    root = Path(tempfile.mkdtemp(prefix="gradloc-pg-"))  # not under pytest's tmp: postgres cannot enter root's
    server = PgServer(root)
    started = time.monotonic()
    try:
        server.start()
        print(f"\nPostgreSQL test server on port {server.port} ({time.monotonic() - started:.1f} s to start)")
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


# ``@pytest.fixture(params=BACKENDS)`` runs a test on both stores; the PostgreSQL one is marked with its tier
BACKENDS = ["sqlite", pytest.param("postgresql", marks=[pytest.mark.integration, pytest.mark.postgres])]


def store_target(request: pytest.FixtureRequest, tmp_path: Path, name: str = "s.db") -> Path | str:
    """For a test parametrized over :data:`BACKENDS`: a fresh store's SQLite path, or a fresh database's URL."""
    return tmp_path / name if request.param == "sqlite" else request.getfixturevalue("pg_url")


@contextlib.contextmanager
def raw(target: Path | str) -> Iterator[Any]:
    """A connection to the store's database outside any store (autocommit), speaking the store's SQL (``?``
    placeholders, SQLite's type names) on either backend: what a test reads or breaks behind the store's back."""
    from gradloc.store.backends import open_backend

    conn = open_backend(target, create=True).connect()
    try:
        yield conn
    finally:
        conn.close()


__all__ = ["BACKENDS", "PG_BIN", "PgServer", "raw", "require_binaries", "running_server", "store_target"]
