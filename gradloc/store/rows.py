"""Table rows of the incident store: records → SQL parameters, and SQL rows → small frozen rows.

``IncidentRow``/``StepRow`` are what tables and charts need without decoding an incident's full
JSON (the ``json`` column) or rebuilding a step's layer columns, which the store does not keep.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gradloc.reports import CorrelatedIncident, StepSummary
from gradloc.store.incident_json import correlated_to_dict

INCIDENT_COLUMNS = ("incident_id, trace_id, job, step, time_unix, status, kinds, global_norm, "
                    "ranks_missing, explained_share, probes")


@dataclass(frozen=True)
class IncidentRow:
    """One line of ``gradloc-agent incidents list``: an incident's headline columns."""

    incident_id: str
    trace_id: str
    job: str
    step: int
    time_unix: float
    status: str
    kinds: tuple[str, ...]
    global_norm: float  # NaN when the step's norm was NaN
    ranks_missing: tuple[int, ...]
    explained_share: float | None
    probes: int

    @staticmethod
    def of(inc: CorrelatedIncident) -> "IncidentRow":
        """The headline of an incident that is not (or not yet) in a store."""
        return IncidentRow(inc.incident_id, inc.trace_id, inc.job, inc.step, inc.time_unix, inc.status, inc.kinds,
                           inc.global_norm, inc.ranks_missing, inc.explained_share, inc.probes)


@dataclass(frozen=True)
class StepRow:
    """One step of one rank as kept in the ``steps`` table (no per-layer columns)."""

    job: str
    rank: int
    step: int
    time_unix: float
    global_norm: float  # NaN when unknown or NaN
    loss: float | None  # None when unknown or NaN
    top_share: float | None
    unattributed_share: float | None
    nonfinite: int
    skipped: bool


def _real(x: float | None) -> float | None:
    """SQLite would turn NaN into NULL anyway; doing it here keeps the rule visible."""
    return None if x is None or math.isnan(x) else x


def incident_params(inc: CorrelatedIncident) -> tuple[Any, ...]:
    """Parameters of the ``incidents`` INSERT (columns in :data:`INCIDENT_COLUMNS` order, then json)."""
    body = json.dumps(correlated_to_dict(inc), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return (inc.incident_id, inc.trace_id, inc.job, inc.step, inc.time_unix, inc.status,
            json.dumps(list(inc.kinds)), _real(inc.global_norm), json.dumps(list(inc.ranks_missing)),
            _real(inc.explained_share), inc.probes, body)


def span_params(inc: CorrelatedIncident) -> Iterator[tuple[Any, ...]]:
    """Parameters of one ``spans`` INSERT per culprit span, in the incident's order (``idx``)."""
    for idx, rs in enumerate(inc.spans):
        s = rs.span
        info = s.sample_info
        yield (inc.incident_id, idx, rs.rank, s.micro_batch, s.sample, s.start, s.end, _real(rs.share),
               s.text, json.dumps(list(s.token_ids)), s.sample_id, info.source if info else None,
               info.origin if info else None)


def step_params(steps: Sequence[StepSummary]) -> Iterator[tuple[Any, ...]]:
    """Parameters of one ``steps`` INSERT per summary (a generator: executemany streams it)."""
    for s in steps:
        tok = s.tokens
        yield (s.job, s.rank, s.step, s.time_unix, _real(s.global_norm), _real(s.loss),
               _real(tok.top_share) if tok else None, _real(tok.unattributed_share) if tok else None,
               int(s.nonfinite), int(bool(s.skipped)))


def incident_row(row: Sequence[Any]) -> IncidentRow:
    """An :class:`IncidentRow` from a SELECT of :data:`INCIDENT_COLUMNS`."""
    (incident_id, trace_id, job, step, time_unix, status, kinds, norm, missing, explained, probes) = row
    return IncidentRow(incident_id, trace_id, job, step, time_unix, status, tuple(json.loads(kinds)),
                       math.nan if norm is None else norm, tuple(json.loads(missing)), explained, probes)


def step_row(row: Sequence[Any]) -> StepRow:
    job, rank, step, time_unix, norm, loss, top, unattributed, nonfinite, skipped = row
    return StepRow(job, rank, step, time_unix, math.nan if norm is None else norm, loss, top, unattributed,
                   nonfinite, bool(skipped))


def where(*filters: tuple[str, Any]) -> tuple[str, list[Any]]:
    """(" WHERE a = ? AND b >= ?", [its arguments]) from (condition, value) pairs, leaving out those whose value is
    None ("", [] when none is left): the one filter builder of the store's queries."""
    kept = [(cond, value) for cond, value in filters if value is not None]
    return (" WHERE " + " AND ".join(c for c, _ in kept)) if kept else "", [v for _, v in kept]


def newest_first(conn: Any, table: str, columns: str, filters: tuple[str, list[Any]], limit: int | None) -> list[Any]:
    """The rows of a findings table (``columns`` of ``table``) that pass ``filters`` (:func:`where`'s), newest first
    (time, step, then rank and insertion order), at most ``limit`` (None: all)."""
    cond, args = filters
    sql = f"SELECT {columns} FROM {table}{cond} ORDER BY time_unix DESC, step DESC, rank, rowid"
    if limit is not None:
        sql, args = sql + " LIMIT ?", [*args, limit]
    return list(conn.execute(sql, args))


def replace_step_rows(conn: Any, table: str, steps: Sequence[StepSummary], insert: str,
                      params: Iterable[tuple[Any, ...]]) -> int:
    """Delete ``table``'s rows of these (job, step, rank)s, then insert ``params``: a re-sent step (delivery is at
    least once) replaces its rows. Inside the caller's transaction; returns the rows written."""
    conn.executemany(f"DELETE FROM {table} WHERE job = ? AND step = ? AND rank = ?",
                     [(s.job, s.step, s.rank) for s in steps])
    return conn.executemany(insert, params).rowcount
