"""The store's inbox (gradloc/store/inbox.py): incidents committed before they are acknowledged,
re-sends recognised, rows marked done in the same transaction as the incident that holds them,
pending rows listed for a restart, old done rows pruned (on both databases), a version-1 file upgraded in place."""
from __future__ import annotations

import sqlite3
import time
from dataclasses import replace
from pathlib import Path

from gradloc.store import SCHEMA_VERSION, inbox
from gradloc.store.incident_json import incident_from_json, incident_to_json
from gradloc.store.schema import _SCHEMA_V1
from gradloc.store.sqlite import IncidentStore
from tests.builders import BELL, INCIDENT_ID, T0, finding, make_incident

WHO = ("job-a", 0, 1)


def test_put_is_idempotent_per_client_and_sequence(target: Path | str) -> None:
    with IncidentStore(target) as store:
        assert store.inbox_put("c1", 7, WHO, [(0, "{}"), (1, "{}")]) == [0, 1]
        assert store.inbox_put("c1", 7, WHO, [(0, "{}"), (1, "{}")]) == []  # the same batch re-sent
        assert store.inbox_put("c2", 7, WHO, [(0, "{}")]) == [0]  # another client's sequence 7
        assert store.inbox_put("c1", 8, WHO, [(0, "{}")]) == [0]
        assert len(store.inbox_pending()) == 4


def test_done_commits_with_the_incident_and_pending_shrinks(target: Path | str) -> None:
    rank_inc = finding(0, 1200, BELL, incident_id=INCIDENT_ID, time_unix=T0)
    with IncidentStore(target) as store:
        store.inbox_put("c1", 1, WHO, [(0, incident_to_json(rank_inc))])
        (key, who, payload), = store.inbox_pending()
        assert key == ("c1", 1, 0) and who == WHO and incident_from_json(payload) == rank_inc
        store.put_incident(make_incident(), inbox_keys=[key])
        assert store.inbox_pending() == []
        assert store.inbox_put("c1", 1, WHO, [(0, incident_to_json(rank_inc))]) == []  # a late re-send: still known


def test_retention_prunes_only_old_done_rows(target: Path | str) -> None:
    with IncidentStore(target) as store:
        store.inbox_put("c1", 1, WHO, [(0, "{}"), (1, "{}")])
        store.put_incident(make_incident(), inbox_keys=[("c1", 1, 0)])
        later = time.time() + inbox.KEEP_DONE_S + 60
        assert store.apply_retention(now=later)["inbox"] == 1
        assert [k for k, _, _ in store.inbox_pending()] == [("c1", 1, 1)]  # not done: kept however old


def test_a_version_1_file_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path)
    conn.executescript(_SCHEMA_V1 + "; PRAGMA user_version = 1;")
    conn.execute("INSERT INTO steps VALUES ('j', 0, 1, 1.0, 1.0, 1.0, 0.0, 0.0, 0, 0)")
    conn.commit()
    conn.close()
    with IncidentStore(path) as store:
        assert store.step_summaries("j")[0].step == 1  # the old rows are still there
        assert store.inbox_put("c1", 1, WHO, [(0, "{}")]) == [0]
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()


def test_payload_round_trip_keeps_every_field() -> None:
    inc = replace(finding(0, 1200, BELL, incident_id=INCIDENT_ID, time_unix=T0), scope="job")
    assert incident_from_json(incident_to_json(inc)) == inc
