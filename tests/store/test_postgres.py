"""The incident store on a real PostgreSQL server, as many daemons share it: two stores (each its own
connections, as two daemons on two machines would have) writing one database at once lose nothing and
never interleave a transaction; two first starts on an empty database create the schema once; a later
schema version's migration runs once; a dropped connection is a failed call, never a dead store; the URL's
password appears in no message. (The tests that hold on both databases are in the other test_*.py files.)"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from gradloc.store import SCHEMA_VERSION, IncidentStore, StoreError, schema
from gradloc.store.backends import open_backend
from gradloc.store.backends import postgresql as pg
from tests.builders import T0, incident_series, make_incident, step_summary
from tests.postgres import raw

pytestmark = [pytest.mark.integration, pytest.mark.postgres]
N = 60  # incidents per writer


def _all_at_once(n: int, fn) -> list[BaseException]:  # noqa: ANN001
    """Run ``fn(i)`` on ``n`` threads released together; the exceptions they raised."""
    barrier, errors = threading.Barrier(n), []

    def run(i: int) -> None:
        try:
            barrier.wait(10)
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def test_two_daemons_writing_one_database_lose_nothing(pg_url: str) -> None:
    """Both store the same incident ids (a replace racing a replace), their own inbox batches and steps."""
    stores = [IncidentStore(pg_url), IncidentStore(pg_url)]
    series = incident_series(N, every_s=1.0)

    def write(i: int) -> None:
        s = stores[i]
        for n, inc in enumerate(series):
            assert s.inbox_put(f"client-{i}", n, ("llm-7b", i, 2), [(0, "{}")], owner=f"daemon:{i}") == [0]
            s.put_incident(replace(inc, note=f"by {i}"), inbox_keys=[(f"client-{i}", n, 0)])
            s.put_steps([step_summary("llm-7b", i, n, T0 + n)])

    assert _all_at_once(2, write) == []
    rows = stores[0].list_incidents(limit=None)
    assert sorted(r.incident_id for r in rows) == sorted(i.incident_id for i in series)  # each once
    assert all(len(stores[1].get_incident(r.incident_id).spans) == 2 for r in rows)  # spans of one version
    assert [(r.rank, r.step) for r in stores[1].step_summaries("llm-7b", last=N)] == \
        [(r, n) for n in range(N) for r in (0, 1)]
    assert stores[0].inbox_pending("daemon:0") == [] == stores[1].inbox_pending("daemon:1")
    for s in stores:
        s.close()


def test_a_write_transaction_excludes_another_daemons_writes_until_it_commits(pg_url: str) -> None:
    first, second = IncidentStore(pg_url), IncidentStore(pg_url)
    done = threading.Event()
    with first._transaction() as conn:
        conn.execute("DELETE FROM incidents")
        writer = threading.Thread(target=lambda: (second.put_incident(make_incident()), done.set()))
        writer.start()
        assert not done.wait(0.5), "another store wrote while this one's transaction was open"
        assert second.list_incidents() == []  # readers take no lock, and see only what was committed
    writer.join(10)
    assert done.is_set() and [r.incident_id for r in first.list_incidents()] == [make_incident().incident_id]
    first.close()
    second.close()


def test_daemons_starting_at_once_on_an_empty_database_create_the_schema_once(pg_url: str) -> None:
    stores: list[IncidentStore] = []
    assert _all_at_once(4, lambda i: stores.append(IncidentStore(pg_url))) == []
    backend = open_backend(pg_url, create=True)
    with raw(pg_url) as conn:
        assert backend.version(conn) == SCHEMA_VERSION
        assert conn.execute("SELECT count(*) FROM gradloc_schema").fetchone()[0] == 1
    stores[0].put_incident(make_incident())
    assert all(s.get_incident(make_incident().incident_id) is not None for s in stores)
    for s in stores:
        s.close()


def test_a_later_schema_versions_migration_runs_once_on_a_database_daemons_share(pg_url: str, monkeypatch) -> None:
    """There is no older PostgreSQL schema (the backend came at version 6); this is the path a version 7
    takes: its step, in the store's SQL, run under the writer lock by whichever daemon starts first."""
    IncidentStore(pg_url).close()  # a version-6 database with a row in it
    with IncidentStore(pg_url) as s:
        s.put_incident(make_incident())
    runs: list[int] = []

    def to_7(conn) -> None:  # noqa: ANN001
        runs.append(1)
        conn.execute("CREATE TABLE notes (incident_id TEXT NOT NULL REFERENCES incidents (incident_id) "
                     "ON DELETE CASCADE, body TEXT NOT NULL, at REAL NOT NULL)")
        conn.execute("INSERT INTO notes (incident_id, body, at) SELECT incident_id, 'migrated', time_unix "
                     "FROM incidents")

    monkeypatch.setattr(schema, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    monkeypatch.setitem(schema._MIGRATIONS, SCHEMA_VERSION, to_7)
    stores: list[IncidentStore] = []
    assert _all_at_once(3, lambda i: stores.append(IncidentStore(pg_url))) == []
    assert runs == [1]
    with raw(pg_url) as conn:
        assert open_backend(pg_url, create=True).version(conn) == SCHEMA_VERSION + 1
        assert conn.execute("SELECT body, at FROM notes").fetchall() == [("migrated", make_incident().time_unix)]
    for s in stores:
        s.close()


def test_a_dropped_connection_fails_one_call_and_the_store_goes_on(pg_url: str, monkeypatch) -> None:
    with IncidentStore(pg_url) as store:
        store.put_incident(make_incident())
        with raw(pg_url) as conn:  # the server ends every other session (a restart, a failover)
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        with pytest.raises(store._backend.errors):
            store.list_incidents()
        assert len(store.list_incidents()) == 1  # the broken connection was not lent again
        monkeypatch.setattr(pg, "PING_AFTER_S", 0.0)  # a connection idle past it is checked before it is lent
        with raw(pg_url) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        time.sleep(0.05)
        store.put_steps([step_summary("j", 0, 1, T0)])
        assert len(store.step_summaries("j")) == 1


def test_the_password_is_in_no_message(pg_server) -> None:
    name = pg_server.database()
    url = pg_server.url(name, password="s3cret-pw")  # the test server trusts: a password is accepted, unused
    with IncidentStore(url) as store:
        assert store.path == url.replace("s3cret-pw", "***") and "s3cret" not in repr(store.path)
    bad = url.replace(f":{pg_server.port}/", ":1/")
    with pytest.raises(StoreError) as err:
        IncidentStore(bad)
    assert "cannot connect" in str(err.value) and "***" in str(err.value) and "s3cret" not in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__
    with pytest.raises(StoreError, match="no incident store in") as err:
        IncidentStore(url.replace(f"/{name}", "/postgres"), create=False)
    assert "s3cret" not in str(err.value)
    pg_server.admin(f"DROP DATABASE {name} WITH (FORCE)")


def test_the_cli_reads_a_postgresql_store_and_never_prints_its_password(pg_server, monkeypatch) -> None:
    from click.testing import CliRunner

    from gradloc.agent.cli import main

    name = pg_server.database()
    url = pg_server.url(name, password="s3cret-pw")
    with IncidentStore(url) as store:
        store.put_incident(make_incident())
    run = CliRunner().invoke
    listed = run(main, ["incidents", "list", "--db", url, "--json"])
    assert listed.exit_code == 0 and make_incident().incident_id in listed.output, listed.output
    monkeypatch.setenv("GRADLOC_DB", url)  # the environment variable takes a URL too
    shown = run(main, ["incidents", "show", make_incident().incident_id[:8], "--json"])
    assert shown.exit_code == 0 and "s3cret" not in shown.output, shown.output
    down = url.replace(f":{pg_server.port}/", ":1/")
    for args in (["incidents", "list", "--store", down], ["quarantine", "list", "--db", down],
                 ["serve", "--store", down, "--ingest", "127.0.0.1:0", "--http", "127.0.0.1:0"]):
        res = run(main, args)
        assert res.exit_code == 1 and "cannot connect" in res.output and "s3cret" not in res.output, (args, res.output)
    pg_server.admin(f"DROP DATABASE {name} WITH (FORCE)")
