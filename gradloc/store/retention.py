"""How long the incident store keeps things, and the deletes that enforce it.

Three bounds, each ``None`` to switch it off: incidents and step rows older than ``max_age_days``;
beyond ``max_incidents`` incidents (oldest go first, across jobs); beyond ``max_step_rows`` step
rows per job (lowest steps go first, so a long run keeps its recent history for the charts). Spans
go with their incident (``ON DELETE CASCADE``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gradloc.errors import ConfigError
from gradloc.store.backends import Connection

_DAY_S = 86400.0


@dataclass(frozen=True)
class RetentionConfig:
    max_age_days: float | None = 30.0
    max_incidents: int | None = 10_000
    max_step_rows: int | None = 1_000_000  # per job

    def __post_init__(self) -> None:
        age = self.max_age_days
        if age is not None and (isinstance(age, bool) or not isinstance(age, (int, float))
                                or not math.isfinite(age) or age <= 0):
            raise ConfigError(f"max_age_days must be a finite number > 0 or None, got {age!r}")
        for name in ("max_incidents", "max_step_rows"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be an int >= 1 or None, got {value!r}")


def apply(conn: Connection, cfg: RetentionConfig, now: float) -> dict[str, int]:
    """Run the deletes inside the caller's transaction; returns how many rows each rule removed."""
    spans_before = _count(conn, "spans")
    out = {"incidents_by_age": 0, "incidents_by_count": 0, "spans": 0, "steps_by_age": 0, "steps_by_count": 0}
    if cfg.max_age_days is not None:
        cutoff = now - cfg.max_age_days * _DAY_S
        out["incidents_by_age"] = conn.execute("DELETE FROM incidents WHERE time_unix < ?", (cutoff,)).rowcount
        out["steps_by_age"] = conn.execute("DELETE FROM steps WHERE time_unix < ?", (cutoff,)).rowcount
    if cfg.max_incidents is not None:
        out["incidents_by_count"] = conn.execute(
            "DELETE FROM incidents WHERE incident_id IN (SELECT incident_id FROM incidents "
            "ORDER BY time_unix DESC, incident_id DESC LIMIT -1 OFFSET ?)", (cfg.max_incidents,)).rowcount
    if cfg.max_step_rows is not None:
        out["steps_by_count"] = _trim_steps(conn, cfg.max_step_rows)
    out["spans"] = spans_before - _count(conn, "spans")  # cascaded deletes are not in rowcount
    return out


def _trim_steps(conn: Connection, keep: int) -> int:
    jobs = [j for (j,) in conn.execute("SELECT job FROM steps GROUP BY job HAVING count(*) > ?", (keep,))]
    deleted = 0
    for job in jobs:
        deleted += conn.execute(
            "DELETE FROM steps WHERE rowid IN (SELECT rowid FROM steps WHERE job = ? "
            "ORDER BY step DESC, rank DESC LIMIT -1 OFFSET ?)", (job, keep)).rowcount
    return deleted


def _count(conn: Connection, table: str) -> int:
    return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
