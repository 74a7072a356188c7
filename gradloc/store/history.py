"""Memory across runs: where a sample or a source was flagged before, in this store (any job).

A culprit span's sample and an outlier are matched by their origin (``SampleInfo.origin``: the same row of the
same file, whatever run it came from) or their sample id (stable only where the loader makes it so), a source by
name. Schema 7 gives the ``spans`` table the culprit's ``source`` and ``origin`` (a v6 file gains them in place;
spans stored before stay NULL there: their incidents' JSON still has them, but they are not matched).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from gradloc.store import groups
from gradloc.store.backends import Connection

SPAN_PROVENANCE = (("source", "TEXT"), ("origin", "TEXT"))


def add_span_provenance(conn: Connection) -> None:
    """Schema 6 → 7, and a fresh file: the spans' source and origin columns, indexed. Idempotent like every
    migration step (the column list is read from a query's description: no PRAGMA, any SQL database)."""
    have = {d[0] for d in conn.execute("SELECT * FROM spans LIMIT 0").description}
    for name, kind in SPAN_PROVENANCE:
        if name not in have:
            conn.execute(f"ALTER TABLE spans ADD COLUMN {name} {kind}")
    conn.execute("CREATE INDEX IF NOT EXISTS spans_origin ON spans (origin) WHERE origin IS NOT NULL")
    conn.execute("CREATE INDEX IF NOT EXISTS sample_outliers_origin ON sample_outliers (origin) WHERE origin IS NOT NULL")


@dataclass(frozen=True, kw_only=True)
class Sighting:
    """One earlier flag of the same sample (or source): an incident's culprit or an outlier."""

    what: str  # "culprit" | "outlier"
    job: str
    step: int
    time_unix: float
    incident_id: str | None = None  # the incident, for a culprit


@dataclass(frozen=True, kw_only=True)
class SeenBefore:
    """Earlier flags of one sample (by origin or sample id), newest first (at most ``limit``), and their count."""

    key: str  # the origin, else the sample id, it was matched by
    count: int
    sightings: tuple[Sighting, ...]

    def text(self) -> str:
        """"seen before: job X, step N (culprit), … — 3 times"."""
        shown = ", ".join(f"job {s.job} step {s.step} ({s.what})" for s in self.sightings[:3])
        more = f" and {self.count - 3} more" if self.count > 3 else ""
        return f"seen before: {shown}{more} — {self.count} time{'s' if self.count != 1 else ''}"


def seen_before(conn: Connection, *, origin: str | None, sample_id: str | None, before_unix: float,
                exclude_incident: str | None = None, limit: int = 10) -> SeenBefore | None:
    """Earlier culprit spans and outliers with this origin (else this sample id) flagged before ``before_unix``."""
    key, column = (origin, "origin") if origin else (sample_id, "sample_id")
    if not key:
        return None
    spans = ("SELECT 'culprit', i.job, i.step, i.time_unix, i.incident_id FROM spans s JOIN incidents i "
             f"ON i.incident_id = s.incident_id WHERE s.{column} = ? AND i.time_unix < ? AND i.incident_id != ?")
    outliers = (f"SELECT 'outlier', job, step, time_unix, NULL FROM sample_outliers WHERE {column} = ? "
                "AND time_unix < ?")
    args = (key, before_unix, exclude_incident or "", key, before_unix)
    rows = conn.execute(f"SELECT DISTINCT * FROM ({spans} UNION ALL {outliers}) AS flags ORDER BY 4 DESC",
                        args).fetchall()
    if not rows:
        return None
    sightings = tuple(Sighting(what=w, job=j, step=int(s), time_unix=float(t), incident_id=i)
                      for w, j, s, t, i in rows[:limit])
    return SeenBefore(key=key, count=len(rows), sightings=sightings)


@dataclass(frozen=True, kw_only=True)
class SourceBefore:
    """Earlier flags of one source in other jobs of the store: culprit spans and outliers, and how many jobs."""

    source: str
    flags: int
    jobs: int

    def text(self) -> str:
        return (f"source {self.source}: flagged {self.flags} time{'s' if self.flags != 1 else ''} before in "
                f"{self.jobs} other job{'s' if self.jobs != 1 else ''}")


def source_before(conn: Connection, *, source: str, before_unix: float, job: str) -> SourceBefore | None:
    """Culprit spans and outliers of ``source`` in jobs other than ``job``, before ``before_unix``."""
    spans = ("SELECT i.job FROM spans s JOIN incidents i ON i.incident_id = s.incident_id "
             "WHERE s.source = ? AND i.time_unix < ? AND i.job != ?")
    outliers = "SELECT job FROM sample_outliers WHERE source = ? AND time_unix < ? AND job != ?"
    row = conn.execute(f"SELECT count(*), count(DISTINCT job) FROM ({spans} UNION ALL {outliers}) AS flags",
                       (source, before_unix, job, source, before_unix, job)).fetchone()
    return SourceBefore(source=source, flags=int(row[0]), jobs=int(row[1])) if row and row[0] else None


class History:
    """The store's memory across runs (``store.history``): reads only, each on a pooled connection."""

    def __init__(self, read: Callable[[], AbstractContextManager[Connection]]) -> None:
        self._read = read

    def seen_before(self, *, origin: str | None, sample_id: str | None, before_unix: float,
                    exclude_incident: str | None = None) -> SeenBefore | None:
        """Earlier culprit spans and outliers of one sample (:func:`seen_before`), or None."""
        with self._read() as conn:
            return seen_before(conn, origin=origin, sample_id=sample_id, before_unix=before_unix,
                               exclude_incident=exclude_incident)

    def source_before(self, *, source: str, before_unix: float, job: str) -> SourceBefore | None:
        """Earlier flags of one source in other jobs (:func:`source_before`), or None."""
        with self._read() as conn:
            return source_before(conn, source=source, before_unix=before_unix, job=job)

    def group_totals(self, job: str | None = None, since_unix: float | None = None,
                     until_unix: float | None = None) -> list[tuple[str, str, int, int]]:
        """(kind, name, samples, tokens) of every data group in the window, summed over ranks and steps."""
        with self._read() as conn:
            return groups.totals(conn, job, since_unix, until_unix)
