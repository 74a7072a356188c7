"""A rank finding's id (what the training process printed) resolves to the stored incident holding it."""
from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from gradloc.store import SCHEMA_VERSION, AmbiguousIdError, IncidentStore, RetentionConfig, aliases
from tests.builders import INCIDENT_ID, T0, make_incident

V2_TABLES = {"incidents", "spans", "steps", "inbox"}  # schema version 2: version 1 and the inbox


def _with_finding_ids(inc, *ids: str):
    """``inc`` whose rank findings carry ``ids``, in order."""
    return replace(inc, findings=tuple(replace(f, incident_id=i) for f, i in zip(inc.findings, ids)))


def test_a_finding_id_full_or_prefix_resolves_to_its_incident(target: Path | str) -> None:
    inc = make_incident()
    finding_ids = [f.incident_id for f in inc.findings]
    assert INCIDENT_ID not in finding_ids and len(finding_ids) == 2  # the rank findings' own ids
    with IncidentStore(target) as store:
        store.put_incident(inc)
        for fid in finding_ids:
            assert store.get_incident(fid) == inc
            assert store.get_incident(fid[:12]) == inc  # what the demo and incident_text print
            assert store.get_incident(f"  {fid[:12]}\n") == inc
        assert store.get_incident(INCIDENT_ID) == inc  # the incident's own id still resolves
        assert store.get_incident("ffff") is None


def test_a_prefix_is_ambiguous_only_across_incidents(target: Path | str) -> None:
    a = _with_finding_ids(make_incident("aa11" + "0" * 28), "bb22" + "1" * 28, "aa19" + "2" * 28)
    b = _with_finding_ids(make_incident("cc33" + "0" * 28, time_unix=T0 + 1), "bb29" + "3" * 28, "dd44" + "4" * 28)
    with IncidentStore(target) as store:
        store.put_incident(a)
        store.put_incident(b)
        assert store.get_incident("aa1") == a  # its own id and one of its findings: one incident
        assert store.get_incident("dd") == b
        with pytest.raises(AmbiguousIdError) as err:
            store.get_incident("bb2")  # a finding of each
        assert err.value.matches == (a.incident_id, b.incident_id)


def test_an_exact_id_wins_over_longer_ids_it_prefixes(target: Path | str) -> None:
    a = _with_finding_ids(make_incident("ab" * 16), "ee" * 16, "ef" * 16)
    b = _with_finding_ids(make_incident("ee" * 16 + "ff", time_unix=T0 + 1), "12" * 16, "34" * 16)
    with IncidentStore(target) as store:
        store.put_incident(a)
        store.put_incident(b)
        assert store.get_incident("ee" * 16) == a  # the finding's full id, though b's id starts with it
        with pytest.raises(AmbiguousIdError):
            store.get_incident("eeee")


def test_the_mapping_follows_its_incident(target: Path | str) -> None:
    inc = make_incident()
    fid = inc.findings[0].incident_id
    with IncidentStore(target, RetentionConfig(max_age_days=1)) as store:
        store.put_incident(inc)
        store.put_incident(inc)  # stored again (replaced): still one mapping
        later = _with_finding_ids(make_incident("c0ffee" * 5 + "00", time_unix=T0 + 5), fid, "77" * 16)
        store.put_incident(later)  # a finding stored again points at the later incident
        assert store.get_incident(fid) == later
        assert store.get_incident(inc.findings[1].incident_id) == inc
        assert store.apply_retention(now=T0 + 2 * 86400)["incidents_by_age"] == 2
        assert store.get_incident(fid) is None
        with store._pool.connection() as conn:
            assert conn.execute("SELECT count(*) FROM finding_ids").fetchone()[0] == 0  # cascaded


def _as_version_2(path: Path) -> None:
    """Turn a current store file into what schema version 2 wrote: drop every later table."""
    conn = sqlite3.connect(path)
    later = [n for (n,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'") if n not in V2_TABLES]
    assert "finding_ids" in later
    for name in later:
        conn.execute(f'DROP TABLE "{name}"')
    conn.execute("PRAGMA user_version = 2")
    conn.commit()
    conn.close()


def test_an_older_file_is_upgraded_and_its_incidents_resolve_by_finding_id(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    inc, other = make_incident(), make_incident("deadbeef" * 4, time_unix=T0 + 1)
    with IncidentStore(path) as store:
        store.put_incident(inc)
        store.put_incident(other)
    _as_version_2(path)
    with IncidentStore(path) as store:  # upgraded in place: the mapping is built from the stored JSON
        assert store.get_incident(inc.findings[1].incident_id[:12]) == inc
        assert store.get_incident(other.findings[0].incident_id) == other
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    rows = sorted(conn.execute("SELECT finding_id, incident_id FROM finding_ids"))
    assert rows == sorted({(f.incident_id, i.incident_id) for i in (inc, other) for f in i.findings})
    aliases.create(conn)  # idempotent: run again, nothing changes
    assert sorted(conn.execute("SELECT finding_id, incident_id FROM finding_ids")) == rows
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()


def test_an_unreadable_stored_incident_does_not_stop_the_upgrade(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    with IncidentStore(path) as store:
        store.put_incident(make_incident())
    _as_version_2(path)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE incidents SET json = '[1, 2]'")
    conn.commit()
    conn.close()
    with IncidentStore(path) as store, store._pool.connection() as conn:  # opens: the upgrade went through
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("SELECT count(*) FROM finding_ids").fetchone()[0] == 0  # nothing to map in '[1, 2]'
        assert conn.execute("SELECT count(*) FROM incidents").fetchone()[0] == 1  # and the row is left alone
