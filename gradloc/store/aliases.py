"""The ids of the rank findings each stored incident holds, so that a lookup by either id resolves.

A training process names its own finding (``Incident.incident_id``: what ``StepReport.incident``,
the demo and the JSONL file show); the correlator merges the findings of every rank for one
(job, step) into a correlated incident with an id of its own (what ``incidents list`` shows). Every
lookup by id (``incidents show``, ``/api/incidents/<id>``, ``/incidents/<id>``) takes either, full
or a unique prefix: the ``finding_ids`` table maps each finding id to the incident holding it. Rows
go with their incident (``ON DELETE CASCADE``); a finding stored again in a later incident points
at the later one.

Schema version 4 adds the table; upgrading an older file fills it from the stored incidents' JSON
(each holds its findings), so incidents stored before the upgrade resolve too.
"""
from __future__ import annotations

import json
from collections.abc import Iterable

from gradloc.store.backends import Connection

DDL = """
CREATE TABLE IF NOT EXISTS finding_ids (
    finding_id  TEXT PRIMARY KEY NOT NULL,
    incident_id TEXT NOT NULL REFERENCES incidents (incident_id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS finding_ids_incident ON finding_ids (incident_id)
"""


def create(conn: Connection) -> None:
    """Create the table if missing and map the findings of the incidents already stored (idempotent)."""
    for statement in DDL.split(";"):
        if statement.strip():
            conn.execute(statement)
    for incident_id, text in conn.execute("SELECT incident_id, json FROM incidents ORDER BY time_unix, incident_id"):
        put(conn, incident_id, _finding_ids(text))


def _finding_ids(text: str) -> list[str]:
    try:
        findings = json.loads(text).get("findings") or []
        return [f["incident_id"] for f in findings if isinstance(f, dict) and isinstance(f.get("incident_id"), str)]
    except (ValueError, AttributeError, TypeError):  # not an incident this gradloc can read: nothing to map
        return []


def put(conn: Connection, incident_id: str, finding_ids: Iterable[str]) -> None:
    """Map ``finding_ids`` to ``incident_id`` (inside the caller's transaction)."""
    rows = [(f, incident_id) for f in dict.fromkeys(finding_ids) if f and f != incident_id]
    conn.executemany("INSERT INTO finding_ids (finding_id, incident_id) VALUES (?, ?) "
                     "ON CONFLICT (finding_id) DO UPDATE SET incident_id = excluded.incident_id", rows)


def resolve(conn: Connection, key: str, upper: str) -> tuple[str, ...]:
    """The ids of the incidents ``key`` may name, sorted, at most 6: the incident with that id, else
    the one holding the finding with that id, else those whose id or one of whose findings' ids
    starts with ``key`` (``upper`` ends that range of strings)."""
    for sql in ("SELECT incident_id FROM incidents WHERE incident_id = ?",
                "SELECT incident_id FROM finding_ids WHERE finding_id = ?"):
        row = conn.execute(sql, (key,)).fetchone()
        if row is not None:
            return (row[0],)
    return tuple(i for (i,) in conn.execute(
        "SELECT incident_id FROM incidents WHERE incident_id >= ? AND incident_id < ? UNION "
        "SELECT incident_id FROM finding_ids WHERE finding_id >= ? AND finding_id < ? "
        "ORDER BY incident_id LIMIT 6", (key, upper, key, upper)))
