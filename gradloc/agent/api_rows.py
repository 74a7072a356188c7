"""What the daemon's API and index page list — incidents, per-sample findings (``SampleOutlier``) and the drift
detector's precursor findings (``PrecursorFinding``) — from its store, or without one from the agent's memory (the
last ``CoreConfig.recent_incidents`` of each), in the store's order and with the same query parameters
(``?job=&since=&limit=``, and per kind ``kind=`` or ``statistic=&pages=``). A bad parameter is a ValueError (400)."""
from __future__ import annotations

from typing import Any

from gradloc.store.rows import IncidentRow

Query = dict[str, list[str]]


def query_int(query: Query, key: str, default: int) -> int:
    try:
        value = int(query.get(key, [default])[-1])
    except ValueError as exc:
        raise ValueError(f"{key} must be an integer") from exc
    if not 1 <= value <= 10_000:
        raise ValueError(f"{key} must be in 1..10000")
    return value


def query_float(query: Query, key: str, default: float | None) -> float | None:
    try:
        return float(query[key][-1]) if key in query else default
    except ValueError as exc:
        raise ValueError(f"{key} must be a number (unix time)") from exc


def query_text(query: Query, key: str) -> str | None:
    return query.get(key, [None])[-1]


def query_bool(query: Query, key: str) -> bool | None:
    text = query_text(query, key)
    if text is None:
        return None
    if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"{key} must be true or false")
    return text.lower() in ("true", "1")


def incident_rows(core: Any, query: Query) -> list[IncidentRow]:
    """Incident headlines (``?job=&since=&limit=``), newest first."""
    job, limit, since = query_text(query, "job"), query_int(query, "limit", 50), query_float(query, "since", None)
    if core.store is not None:
        return core.store.list_incidents(job=job, limit=limit, since_unix=since)
    recent = [i for i in reversed(core.recent) if (job is None or i.job == job) and (since is None or i.time_unix >= since)]
    return [IncidentRow.of(i) for i in recent[:limit]]


def outlier_rows(core: Any, query: Query) -> list[Any]:
    """Per-sample findings (``?job=&kind=&since=&limit=``), newest first."""
    job, kind = query_text(query, "job"), query_text(query, "kind")
    limit, since = query_int(query, "limit", 50), query_float(query, "since", None)
    if core.store is not None:
        return core.store.list_outliers(job=job, kind=kind, since_unix=since, limit=limit)
    return _newest(core.recent_outliers, limit, job=job, since=since, kind=kind)


def precursor_rows(core: Any, query: Query) -> list[Any]:
    """The drift detector's findings (``?job=&statistic=&pages=&since=&limit=``; ``pages=true``: only the paging
    ones), newest first."""
    job, statistic, pages = query_text(query, "job"), query_text(query, "statistic"), query_bool(query, "pages")
    limit, since = query_int(query, "limit", 50), query_float(query, "since", None)
    if core.store is not None:
        return core.store.list_precursor_findings(job=job, statistic=statistic, pages=pages, since_unix=since,
                                                  limit=limit)
    return _newest(core.recent_precursors, limit, job=job, since=since, statistic=statistic, pages=pages)


def _newest(recent: Any, limit: int, *, job: str | None, since: float | None, **equal: Any) -> list[Any]:
    """The remembered findings that match, in the store's order (newest first, then step, then rank)."""
    newest = sorted(list(recent), key=lambda o: (-o.time_unix, -o.step, o.rank))  # a snapshot: the worker appends
    return [o for o in newest if (job is None or o.job == job) and (since is None or o.time_unix >= since)
            and all(value is None or getattr(o, name) == value for name, value in equal.items())][:limit]
