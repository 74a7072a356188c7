"""The incident store: schema and pragmas, atomic writes, queries, retention, threads.

Tests taking ``target`` run on both databases (SQLite, then PostgreSQL: tests/store/conftest.py); those
taking ``db`` are about SQLite files (WAL, pragmas, triggers, file paths)."""
from __future__ import annotations

import dataclasses
import json
import math
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from gradloc.errors import ConfigError
from gradloc.store import (
    SCHEMA_VERSION,
    AmbiguousIdError,
    IncidentRow,
    IncidentStore,
    RetentionConfig,
    SchemaVersionError,
    StoreError,
    default_db_path,
)
from gradloc.store import sqlite as store_sqlite
from gradloc.store.backends import open_backend
from tests.builders import (
    INCIDENT_ID,
    PARTIAL_TRACE_ID,
    T0,
    incident_series,
    make_incident,
    nonfinite_incident,
    step_summary,
)
from tests.postgres import raw

DAY = 86400.0


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "incidents.db"


@pytest.fixture
def store(target: Path | str):
    s = IncidentStore(target)
    yield s
    s.close()


def _raw(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(db, isolation_level=None)


def _spans(target: Path | str, incident_id: str) -> list[tuple]:
    with raw(target) as conn:
        return [tuple(r) for r in conn.execute('SELECT idx, rank, micro_batch, sample, start, "end", share, text, '
                                               "token_ids, sample_id FROM spans WHERE incident_id = ? ORDER BY idx",
                                               (incident_id,))]


# -- schema and pragmas ------------------------------------------------------------------------------

def test_fresh_file_gets_the_current_schema_in_wal_mode_with_parents_created(tmp_path: Path) -> None:
    path = tmp_path / "state" / "gradloc" / "incidents.db"
    with IncidentStore(path) as s, s._pool.connection() as conn:
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    conn = _raw(path)  # a fresh connection: WAL is persistent in the file, not a per-connection setting
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    tables = {n for (n,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    assert {"incidents", "spans", "steps", "inbox", "finding_ids"} <= tables
    plan = conn.execute("EXPLAIN QUERY PLAN SELECT * FROM steps WHERE job = 'a' AND step > 5").fetchall()
    assert "steps_job_step" in str(plan)
    conn.close()


def test_reopening_keeps_data(target: Path | str) -> None:
    with IncidentStore(target) as s:
        s.put_incident(make_incident())
    with IncidentStore(target) as s:
        assert s.get_incident(INCIDENT_ID) == make_incident()


def test_a_newer_schema_version_is_refused_and_left_untouched(target: Path | str) -> None:
    """On open, and on a write of a store opened before a newer gradloc upgraded the database."""
    backend = open_backend(target, create=True)
    with IncidentStore(target) as opened:
        with raw(target) as conn:
            backend.set_version(conn, SCHEMA_VERSION + 1)
        with pytest.raises(SchemaVersionError, match=f"schema version {SCHEMA_VERSION + 1}.*newer gradloc"):
            opened.put_incident(make_incident())
        assert opened.list_incidents() == []
    with pytest.raises(SchemaVersionError, match=f"schema version {SCHEMA_VERSION + 1}.*newer gradloc"):
        IncidentStore(target)
    with raw(target) as conn:
        assert backend.version(conn) == SCHEMA_VERSION + 1


def test_foreign_databases_are_refused(target: Path | str) -> None:
    with raw(target) as conn:
        conn.execute("CREATE TABLE notes (x TEXT)")
    with pytest.raises(StoreError, match="without an incident-store schema version"):
        IncidentStore(target)


def test_junk_files_are_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database, just some text that is long enough" * 10)
    with pytest.raises(StoreError, match="junk.db"):
        IncidentStore(junk)


def test_missing_file_is_an_error_with_create_false_and_not_created(db: Path) -> None:
    with pytest.raises(StoreError, match="no incident store at"):
        IncidentStore(db, create=False)
    assert not db.exists()


def test_a_database_without_the_schema_is_an_error_with_create_false_and_left_empty(target: Path | str) -> None:
    with raw(target):  # a SQLite file exists now, empty: as a fresh PostgreSQL database is
        pass
    with pytest.raises(StoreError, match="no incident store in"):
        IncidentStore(target, create=False)
    with raw(target) as conn:
        assert not open_backend(target, create=True).has_tables(conn)


def test_in_memory_databases_and_bad_retention_are_refused(db: Path) -> None:
    with pytest.raises(StoreError, match="file path"):
        IncidentStore(":memory:")
    with pytest.raises(ConfigError, match="RetentionConfig"):
        IncidentStore(db, retention={"max_age_days": 3})


def test_a_busy_or_unreachable_database_is_unavailable_a_bad_call_is_not(store: IncidentStore) -> None:
    """What the daemon answers a client whose incidents it could not commit: resend later, or not at all."""
    if store._backend.dialect == "sqlite":
        busy: list[BaseException] = [sqlite3.OperationalError("database is locked")]
    else:
        import psycopg

        busy = [psycopg.OperationalError("server closed the connection"), StoreError("cannot connect to …")]
    assert all(store.unavailable(e) for e in busy)
    bad = [ValueError("bad"), SchemaVersionError("newer"), store._backend.errors[0]("a bad statement")]
    assert not any(store.unavailable(e) for e in bad)


def test_a_closed_store_refuses_work(target: Path | str) -> None:
    s = IncidentStore(target)
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.list_incidents()


# -- writing incidents ---------------------------------------------------------------------------

def test_put_incident_fills_all_three_places(store: IncidentStore, target: Path | str) -> None:
    inc = make_incident()
    store.put_incident(inc)
    with raw(target) as conn:
        row = conn.execute("SELECT trace_id, job, step, time_unix, status, kinds, global_norm, ranks_missing, "
                           "explained_share, probes, json FROM incidents").fetchone()
    assert row[:10] == (PARTIAL_TRACE_ID, "llm-7b", 1200, T0, "partial", '["grad_spike", "loss_spike"]', 4.95, "[2]", 0.93, 2)
    assert json.loads(row[10])["findings"][0]["localization"]["spans"][0]["text"] == " bell"
    assert _spans(target, INCIDENT_ID) == [
        (0, 0, 3, 1, 41, 42, pytest.approx(0.648), " bell", "[66]", "s1200-3-1"),
        (1, 1, 0, 2, 7, 9, pytest.approx(0.14), "zebra\tqu", "[901, 77]", None)]


def test_putting_the_same_id_again_replaces_the_incident_and_its_spans(store: IncidentStore,
                                                                        target: Path | str) -> None:
    store.put_incident(make_incident())
    later = dataclasses.replace(make_incident(spans=False), status="complete", ranks_missing=())
    store.put_incident(later)
    assert store.get_incident(INCIDENT_ID) == later
    assert _spans(target, INCIDENT_ID) == []
    assert [r.status for r in store.list_incidents()] == ["complete"]


def test_a_failing_span_insert_leaves_the_previous_version_intact(db: Path) -> None:
    """A trigger aborts the second span row: neither the replacement nor a new incident half-lands."""
    store = IncidentStore(db)
    old = make_incident()
    store.put_incident(old)
    with _raw(db) as conn:
        conn.execute("CREATE TRIGGER boom BEFORE INSERT ON spans WHEN NEW.idx = 1 "
                     "BEGIN SELECT RAISE(ABORT, 'disk full, say'); END")
    with pytest.raises(sqlite3.IntegrityError, match="disk full"):
        store.put_incident(dataclasses.replace(old, step=9999, status="complete"))
    with pytest.raises(sqlite3.IntegrityError):
        store.put_incident(make_incident("ab" * 16))
    assert store.get_incident(INCIDENT_ID) == old
    assert len(_spans(db, INCIDENT_ID)) == 2
    assert store.get_incident("ab" * 16) is None and _spans(db, "ab" * 16) == []
    store.close()


def test_a_constraint_violation_midway_rolls_everything_back(store: IncidentStore, target: Path | str,
                                                             monkeypatch) -> None:
    real = store_sqlite.span_params

    def second_row_has_no_rank(inc):
        rows = list(real(inc))
        yield rows[0]
        yield rows[1][:2] + (None,) + rows[1][3:]  # rank NOT NULL

    monkeypatch.setattr(store_sqlite, "span_params", second_row_has_no_rank)
    with pytest.raises(store._backend.errors, match="(?i)not[ -]null"):
        store.put_incident(make_incident())
    with raw(target) as conn:
        assert conn.execute("SELECT count(*) FROM incidents").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM spans").fetchone()[0] == 0
    monkeypatch.undo()
    store.put_incident(make_incident())  # the store is still usable after the rollback
    assert store.get_incident(INCIDENT_ID) == make_incident()


# -- reading incidents ---------------------------------------------------------------------------

def test_get_incident_by_unique_prefix_and_ambiguous_prefixes(store: IncidentStore) -> None:
    for inc in incident_series(3):
        store.put_incident(inc)
    assert store.get_incident("0001").step == 110
    assert store.get_incident(" 0002" + INCIDENT_ID[4:] + " ").step == 120
    with pytest.raises(AmbiguousIdError, match="'000' is ambiguous") as err:
        store.get_incident("000")
    assert err.value.matches == tuple(f"{i:04x}" + INCIDENT_ID[4:] for i in range(3))
    assert store.get_incident("ffff") is None
    with pytest.raises(ValueError, match="required"):
        store.get_incident("  ")


def test_list_incidents_newest_first_with_filters(store: IncidentStore) -> None:
    others = [make_incident(c * 32, job="other", step=7, time_unix=T0 + t) for c, t in (("a", 1800), ("b", 5400))]
    for inc in incident_series(4) + others:
        store.put_incident(inc)
    rows = store.list_incidents()
    assert [(r.job, r.time_unix) for r in rows] == [
        ("llm-7b", T0 + 3 * 3600), ("llm-7b", T0 + 2 * 3600), ("other", T0 + 5400), ("llm-7b", T0 + 3600),
        ("other", T0 + 1800), ("llm-7b", T0)]
    assert [r.step for r in store.list_incidents(job="llm-7b", limit=2)] == [130, 120]
    assert [r.step for r in store.list_incidents(since_unix=T0 + 5400)] == [130, 120, 7]
    assert store.list_incidents(job="nope") == []
    assert len(store.list_incidents(limit=None)) == 6
    with pytest.raises(ValueError, match="limit"):
        store.list_incidents(limit=0)
    assert rows[0] == IncidentRow("0003" + INCIDENT_ID[4:], PARTIAL_TRACE_ID, "llm-7b", 130, T0 + 3 * 3600, "partial",
                                  ("grad_spike", "loss_spike"), 4.95, (2,), 0.93, 2)


def test_non_finite_incident_rows_and_round_trip(store: IncidentStore) -> None:
    inc = nonfinite_incident()
    store.put_incident(inc)
    (row,) = store.list_incidents()
    assert math.isnan(row.global_norm) and row.explained_share is None and row.ranks_missing == ()
    assert repr(store.get_incident(inc.incident_id)) == repr(inc)


def test_iter_incidents_pages_oldest_first(store: IncidentStore) -> None:
    series = incident_series(5)
    for inc in reversed(series):
        store.put_incident(inc)
    store.put_incident(make_incident("ee" * 16, job="other", time_unix=T0 + 100))
    assert [i.incident_id for i in store.iter_incidents(job="llm-7b", batch=2)] == [i.incident_id for i in series]
    assert [i.step for i in store.iter_incidents(since_unix=T0 + 2 * 3600, batch=2)] == [120, 130, 140]
    assert [i.job for i in store.iter_incidents(batch=1)][:2] == ["llm-7b", "other"]
    assert list(store.iter_incidents(batch=3))[-1] == series[-1]


# -- steps ------------------------------------------------------------------------------------

@pytest.mark.wallclock  # asserts a wall-clock bound (tests/conftest.py: never beside a multi-process test)
def test_put_steps_handles_thousands_of_rows_per_second(store: IncidentStore) -> None:
    rows = [step_summary("llm-7b", r, s, T0 + s) for s in range(2000) for r in range(3)]
    start = time.perf_counter()
    assert store.put_steps(rows) == 6000
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"6000 step rows took {elapsed:.2f} s"
    last = store.step_summaries("llm-7b", rank=1, last=3)
    assert [(r.rank, r.step) for r in last] == [(1, 1997), (1, 1998), (1, 1999)]
    assert last[0].global_norm == pytest.approx(0.8 + 0.1997) and last[0].top_share == 0.1
    assert last[0].unattributed_share == 0.02 and last[0].loss == 2.5 and last[0].skipped is False
    assert [(r.step, r.rank) for r in store.step_summaries("llm-7b", last=2)] == [
        (1998, 0), (1998, 1), (1998, 2), (1999, 0), (1999, 1), (1999, 2)]


def test_a_re_run_step_replaces_its_row_and_odd_values_map_to_null(store: IncidentStore) -> None:
    store.put_steps([step_summary("j", 0, 5, T0)])
    rerun = dataclasses.replace(step_summary("j", 0, 5, T0 + 9, loss=math.nan, skipped=True), tokens=None)
    assert store.put_steps([rerun]) == 1
    (row,) = store.step_summaries("j")
    assert (row.time_unix, row.loss, row.top_share, row.skipped) == (T0 + 9, None, None, True)
    assert store.put_steps([]) == 0
    with pytest.raises(ValueError, match="last"):
        store.step_summaries("j", last=0)


# -- retention ---------------------------------------------------------------------------------

def test_retention_by_age_deletes_old_incidents_spans_and_steps(target: Path | str) -> None:
    with IncidentStore(target, RetentionConfig(max_age_days=30, max_incidents=None, max_step_rows=None)) as s:
        for i, age in enumerate((40, 29, 0)):
            s.put_incident(make_incident(f"{i:02x}" * 16, time_unix=T0 - age * DAY))
        s.put_steps([step_summary("j", 0, 1, T0 - 31 * DAY), step_summary("j", 0, 2, T0 - DAY)])
        counts = s.apply_retention(now=T0)
        assert counts == {"incidents_by_age": 1, "incidents_by_count": 0, "spans": 2, "steps_by_age": 1,
                          "steps_by_count": 0, "inbox": 0, "sample_outliers": 0, "precursor_findings": 0,
                          "step_groups": 0}
        assert [r.incident_id for r in s.list_incidents()] == ["02" * 16, "01" * 16]
        assert [r.step for r in s.step_summaries("j")] == [2]
        assert _spans(target, "00" * 16) == [] and len(_spans(target, "01" * 16)) == 2


def test_retention_by_count_keeps_the_newest(target: Path | str) -> None:
    with IncidentStore(target, RetentionConfig(max_age_days=None, max_incidents=2, max_step_rows=5)) as s:
        series = incident_series(5)
        for inc in series:
            s.put_incident(inc)
        s.put_steps([step_summary("a", 0, n, T0) for n in range(10)] + [step_summary("b", 1, n, T0) for n in range(3)])
        counts = s.apply_retention(now=T0 + 1e9)  # age is off: nothing expires however late it is
        assert counts == {"incidents_by_age": 0, "incidents_by_count": 3, "spans": 6, "steps_by_age": 0,
                          "steps_by_count": 5, "inbox": 0, "sample_outliers": 0, "precursor_findings": 0,
                          "step_groups": 0}
        assert [r.incident_id for r in s.list_incidents()] == [series[4].incident_id, series[3].incident_id]
        assert [r.step for r in s.step_summaries("a")] == [5, 6, 7, 8, 9]
        assert [r.step for r in s.step_summaries("b")] == [0, 1, 2]
        assert s.apply_retention(now=T0)["incidents_by_count"] == 0


@pytest.mark.parametrize("kwargs", [{"max_age_days": 0}, {"max_age_days": -1.0}, {"max_age_days": math.nan},
                                    {"max_age_days": True}, {"max_age_days": "30"}, {"max_incidents": 0},
                                    {"max_incidents": 2.5}, {"max_step_rows": -3}, {"max_step_rows": False}])
def test_retention_config_is_validated(kwargs) -> None:
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        RetentionConfig(**kwargs)


def test_retention_config_accepts_none_and_defaults() -> None:
    assert RetentionConfig(None, None, None).max_incidents is None
    assert RetentionConfig().max_age_days == 30.0


# -- threads and WAL ---------------------------------------------------------------------------

def test_a_long_read_does_not_block_a_write(db: Path) -> None:
    """WAL: a reader holding a snapshot neither blocks the writer nor sees the new row mid-read."""
    store = IncidentStore(db)
    store.put_incident(make_incident())
    reader = _raw(db)
    reader.execute("BEGIN")
    assert reader.execute("SELECT count(*) FROM incidents").fetchone()[0] == 1
    start = time.perf_counter()
    store.put_incident(make_incident("ab" * 16))
    assert time.perf_counter() - start < 2.0  # rollback-journal mode would wait out the 5 s busy timeout
    assert reader.execute("SELECT count(*) FROM incidents").fetchone()[0] == 1
    reader.execute("COMMIT")
    assert reader.execute("SELECT count(*) FROM incidents").fetchone()[0] == 2
    reader.close()
    store.close()


def test_readers_on_other_threads_only_ever_see_whole_incidents(store: IncidentStore) -> None:
    n, errors, seen_midway = 120, [], threading.Event()
    done = threading.Event()

    def write() -> None:
        try:
            for i, inc in enumerate(incident_series(n, every_s=1.0)):
                store.put_incident(inc)
                store.put_steps([step_summary("llm-7b", r, i, T0 + i) for r in range(4)])
                if i == n // 2:
                    assert seen_midway.wait(10), "no reader ran while the writer was writing"
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            done.set()

    def read() -> None:
        try:
            while not done.is_set():
                rows = store.list_incidents(limit=None)
                if 0 < len(rows) < n:
                    seen_midway.set()
                for row in rows[:3]:
                    inc = store.get_incident(row.incident_id)
                    assert inc is not None and len(inc.spans) == 2 and inc.step == row.step
                store.step_summaries("llm-7b", last=5)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert seen_midway.is_set() and len(store.list_incidents(limit=None)) == n


# -- default path ------------------------------------------------------------------------------

def test_default_db_path_follows_env_then_xdg_then_home(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GRADLOC_DB", str(tmp_path / "x.db"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_db_path() == tmp_path / "x.db"
    monkeypatch.delenv("GRADLOC_DB")
    assert default_db_path() == tmp_path / "state" / "gradloc" / "incidents.db"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")  # the XDG spec says: ignore relative paths
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_db_path() == tmp_path / "home" / ".local" / "state" / "gradloc" / "incidents.db"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_db_path() == tmp_path / "home" / ".local" / "state" / "gradloc" / "incidents.db"


def test_an_incident_is_found_by_its_trace_id(store: IncidentStore) -> None:
    """What an exemplar carries leads back to the incident (the agent's /incidents/trace/<id>)."""
    store.put_incident(make_incident())
    assert store.incident_id_of_trace(PARTIAL_TRACE_ID) == INCIDENT_ID
    assert store.incident_id_of_trace("0" * 32) is None
