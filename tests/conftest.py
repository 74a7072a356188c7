"""Suite-wide settings.

- The embedded incident store of every ``watch`` in the tests goes to a temp dir, never to the
  developer's ``~/.local/state/gradloc``.
- A real PostgreSQL server (tests/postgres.py) is started once per session, on the first test that asks
  for ``pg_url`` (a fresh empty database per test, dropped after it), and stopped at the end.
- Every process the tests start runs torch on one intra-op thread (``OMP_NUM_THREADS=1``): with two
  OpenMP threads on a busy 2-core machine, spinning barriers made subprocess runs 10–50× slower
  (a demo that takes 15 s hit a 300 s timeout). In-process tests set it per test (tests/helpers.py).
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _isolated_incident_db(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("GRADLOC_DB", str(tmp_path_factory.mktemp("gradloc-db") / "incidents.db"))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def pg_server():
    from tests.postgres import running_server

    with running_server() as server:
        yield server


@pytest.fixture
def pg_url(pg_server):
    """A new empty database on the session's PostgreSQL server (CREATE DATABASE: milliseconds), dropped after."""
    name = pg_server.database()
    yield pg_server.url(name)
    pg_server.admin(f"DROP DATABASE {name} WITH (FORCE)")
