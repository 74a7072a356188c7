"""What the daemon should have answered and stored, for the ingest fuzz test.

``expected_codes`` decodes every message with the daemon's own :class:`BatchDecoder` in this
process (its layer-table cache seeded with the valid tables, which the daemon learned from the
valid batches sent first): the daemon must answer the same code, or UNAVAILABLE where it accepts
(overloaded). ``check_store`` reads the SQLite file after the daemon stopped and checks it against
the batches the daemon acknowledged: nothing partial, nothing altered, nothing stored that was not
acknowledged, and every acknowledged record stored unless another one legitimately superseded it.
"""
from __future__ import annotations

import json
import sqlite3
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from gradloc.agent.limits import cut_culprits
from gradloc.records import to_dict
from gradloc.store.incident_json import correlated_from_dict
from gradloc.store.rows import INCIDENT_COLUMNS, IncidentRow, incident_row, span_params, step_params
from gradloc.transport.codec import BatchDecoder, DecodedBatch
from gradloc.transport.server import _CODES
from gradloc.transport.validate import RejectedBatch
from gradloc.transport.wire import pb

OK = grpc.StatusCode.OK
MAX_CULPRITS = 256  # the daemon's --max-culprits in the fuzz test (its default)
_STEP_COLUMNS = "job, rank, step, time_unix, global_norm, loss, top_share, unattributed_share, nonfinite, skipped"


def expected_codes(bases: list[pb.IngestBatch], messages: list[bytes], max_message_bytes: int,
                   max_culprits: int = MAX_CULPRITS) -> list[tuple[grpc.StatusCode, DecodedBatch | None]]:
    """The code the daemon must answer each message with, and for an accepted one the batch as
    the daemon keeps it (incidents cut to ``max_culprits`` culprits and spans, as its limits do)."""
    decoder = BatchDecoder(max_message_bytes=max_message_bytes, keep_top_tokens=False)
    for b in bases:
        decoder.decode(b.SerializeToString())
    out: list[tuple[grpc.StatusCode, DecodedBatch | None]] = []
    for data in messages:
        try:
            batch = decoder.decode(data)
            out.append((OK, replace(batch, incidents=tuple(cut_culprits(i, max_culprits) for i in batch.incidents))))
        except RejectedBatch as exc:
            out.append((_CODES.get(exc.reason, grpc.StatusCode.INVALID_ARGUMENT), None))
    return out


def check_store(db: Path, acked: list[DecodedBatch], unavailable: list[DecodedBatch], cutoff: float) -> dict[str, int]:
    """Assert the store holds exactly what the acknowledged batches say (``cutoff``: retention may
    have deleted records dated before it). Returns a few counts for the report."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        steps = _check_steps(conn, acked, cutoff)
        stored = _check_incidents(conn)
        return {"step_rows": steps, **_check_findings(conn, stored, acked, unavailable, cutoff)}
    finally:
        conn.close()


def _check_steps(conn: sqlite3.Connection, acked: list[DecodedBatch], cutoff: float) -> int:
    rows = conn.execute(f"SELECT {_STEP_COLUMNS} FROM steps").fetchall()
    for job, rank, step, _, _, _, _, _, nonfinite, skipped in rows:
        assert job and rank >= 0 and step >= 0 and nonfinite >= 0 and skipped in (0, 1), rows
    want = [s for b in acked for s in b.steps]
    keys = Counter((s.job, s.rank, s.step) for s in want)
    got = {tuple(r[:3]): r for r in rows}
    assert set(got) <= set(keys), f"stored steps nobody acknowledged: {sorted(set(got) - set(keys))[:5]}"
    aged = {(s.job, s.rank, s.step) for s in want if s.time_unix < cutoff}  # retention may have deleted these
    missing = [k for k in keys if k not in got and k not in aged]
    assert not missing, f"{len(missing)} acknowledged steps not stored, e.g. {missing[:5]}"
    for s in want:
        key = (s.job, s.rank, s.step)
        if keys[key] == 1 and key in got:  # (acknowledged twice: the later write wins, either is right)
            assert got[key] == next(step_params([s])), (got[key], s)
    return len(rows)


def _check_incidents(conn: sqlite3.Connection) -> list[Any]:
    """Every incident row: its JSON decodes, its columns agree with the JSON, its spans rows are
    exactly the JSON's spans; no span without its incident. Returns the decoded incidents."""
    out = []
    for row in conn.execute(f"SELECT {INCIDENT_COLUMNS}, json FROM incidents").fetchall():
        inc = correlated_from_dict(json.loads(row[-1]))
        head, want = incident_row(row[:-1]), IncidentRow.of(inc)
        assert to_dict(head) == to_dict(want), (head, want)
        spans = conn.execute('SELECT incident_id, idx, rank, micro_batch, sample, start, "end", share, text, '
                             "token_ids, sample_id, source, origin FROM spans WHERE incident_id = ? ORDER BY idx",
                             (inc.incident_id,)).fetchall()
        assert spans == list(span_params(inc)), inc.incident_id
        out.append(inc)
    orphans = conn.execute("SELECT count(*) FROM spans WHERE incident_id NOT IN (SELECT incident_id FROM incidents)")
    assert orphans.fetchone()[0] == 0
    return out


def _check_findings(conn: sqlite3.Connection, stored: list[Any], acked: list[DecodedBatch],
                    unavailable: list[DecodedBatch], cutoff: float) -> dict[str, int]:
    """Stored rank incidents = acknowledged ones, byte for byte (as dicts). An acknowledged incident
    may be absent only when another acknowledged one superseded it: same inbox key (client id,
    sequence — a re-send), same incident id, or same (job, step, rank) while the first was open."""
    sent = [(b, j, inc) for b in acked for j, inc in enumerate(b.incidents)]
    by_id: dict[str, list[dict]] = {}
    for _, _, inc in sent:
        by_id.setdefault(inc.incident_id, []).append(to_dict(inc))
    findings = [f for inc in stored for f in inc.findings]
    for f in findings:
        assert to_dict(f) in by_id.get(f.incident_id, []), (
            f"stored incident nobody acknowledged: {f.incident_id}; first differences from the acknowledged "
            f"ones with its id: {[_first_diff(to_dict(f), d) for d in by_id.get(f.incident_id, [])]}")
    batches = Counter((b.client.client_id, b.sequence) for b in [*acked, *unavailable])
    ids = Counter(inc.incident_id for _, _, inc in sent)
    ranks = Counter((inc.job, inc.step, inc.rank) for _, _, inc in sent)
    clear = {(b.client.client_id, b.sequence, j): inc for b, j, inc in sent
             if batches[(b.client.client_id, b.sequence)] == 1 and ids[inc.incident_id] == 1
             and ranks[(inc.job, inc.step, inc.rank)] == 1 and inc.time_unix >= cutoff}
    stored_ids = Counter(f.incident_id for f in findings)
    lost = [k for k, inc in clear.items() if stored_ids[inc.incident_id] != 1]
    assert not lost, f"{len(lost)} acknowledged incidents not stored (or stored twice), e.g. {lost[:5]}"
    # After a clean stop every acknowledged incident is settled (stored, or replaced by one that is):
    # an open row would be correlated again, and stored again, at the next start.
    open_rows = conn.execute("SELECT client_id, sequence, idx FROM inbox WHERE done = 0").fetchall()
    assert not open_rows, f"{len(open_rows)} inbox rows left open, e.g. {open_rows[:5]}"
    return {"incidents": len(stored), "findings": len(findings), "acked_incidents": len(sent),
            "unambiguous_incidents": len(clear)}


def _first_diff(a: Any, b: Any, path: str = "") -> str | None:
    """The path of the first difference between two to_dict trees (None when equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() | b.keys():
            d = _first_diff(a.get(k), b.get(k), f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _first_diff(x, y, f"{path}[{i}]"))), None)
    if isinstance(a, list) and isinstance(b, list):
        return f"{path}: {len(a)} items != {len(b)}"
    return None if a == b else f"{path}: {a!r:.80} != {b!r:.80}"
