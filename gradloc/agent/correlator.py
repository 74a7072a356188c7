"""Cross-rank correlation: the per-rank findings of one (job, step) become ONE incident.

Each rank localizes on its own micro-batches (its probes cannot see another rank's data). The
correlator gathers, for every (job, step) some rank flagged, the step records and incidents of all
ranks, and closes the incident when every expected rank has reported the step, or when the
straggler deadline passes — a rank that never reports is named in ``ranks_missing`` instead of
being waited on forever.

Shares: a rank's share is its part of the per-token attribution score summed over the reporting
ranks (each rank's ``TokenStats.total_score`` measures its own tokens' contribution before the
gradient all-reduce). Micro-batch and span shares are the rank-local shares scaled by it, so the
path global → micro-batch → rank → sample → token spans reads in one unit.

Single-threaded by design: the agent's worker thread owns it (no locks).
"""
from __future__ import annotations

import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from gradloc.agent.merge import RankView, merge_incident
from gradloc.errors import ConfigError
from gradloc.records import Incident
from gradloc.reports import CorrelatedIncident, StepPoint, StepSummary


@dataclass(frozen=True)
class CorrelatorConfig:
    straggler_deadline_s: float = 10.0  # wait this long after the first finding for the other ranks
    history_steps: int = 64  # recent steps kept per (job, rank) for findings that arrive late
    max_pending: int = 1024  # open incidents; beyond this the oldest closes early (as partial)

    def __post_init__(self) -> None:
        if not self.straggler_deadline_s > 0:
            raise ConfigError("straggler_deadline_s must be > 0")
        if self.history_steps < 1 or self.max_pending < 1:
            raise ConfigError("history_steps and max_pending must be >= 1")


@dataclass
class _Pending:
    job: str
    step: int
    deadline: float
    incidents: dict[int, Incident] = field(default_factory=dict)

_HEX32 = re.compile("[0-9a-f]{32}")


class Correlator:
    """Feed it ``on_step``/``on_incident``/``declare``; call ``poll`` regularly; closed incidents
    go to ``emit``."""

    def __init__(self, emit: Callable[[CorrelatedIncident], None], config: CorrelatorConfig | None = None,
                 new_trace_id: Callable[[], str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or CorrelatorConfig()
        self._emit, self._clock = emit, clock
        self._new_trace_id = new_trace_id or (lambda: uuid.uuid4().hex)
        self._world: dict[str, int] = {}
        self._seen: dict[str, set[int]] = {}
        self._recent: dict[tuple[str, int], OrderedDict[int, RankView]] = {}
        self._pending: OrderedDict[tuple[str, int], _Pending] = OrderedDict()
        self._given: OrderedDict[str, tuple[str, int]] = OrderedDict()  # recent incident ids -> (job, step)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def jobs(self) -> set[str]:
        """The jobs anything is kept for (world size, ranks seen, recent steps)."""
        return set(self._world) | set(self._seen) | {job for job, _ in self._recent}

    def declare(self, job: str, rank: int, world_size: int) -> None:
        """A client said which job/rank it is and how many ranks the job has."""
        self._world[job] = max(self._world.get(job, 0), world_size)
        self._seen.setdefault(job, set()).add(rank)

    def on_step(self, s: StepSummary) -> None:
        self._seen.setdefault(s.job, set()).add(s.rank)
        ring = self._recent.setdefault((s.job, s.rank), OrderedDict())
        ring[s.step] = RankView(s.rank, s.global_norm, s.loss, s.tokens, s.norm_mean, s.norm_threshold)
        while len(ring) > self.config.history_steps:
            ring.popitem(last=False)
        self._check((s.job, s.step))

    def on_incident(self, inc: Incident) -> None:
        self._seen.setdefault(inc.job, set()).add(inc.rank)
        key = (inc.job, inc.step)
        p = self._pending.get(key)
        if p is None:
            p = self._pending[key] = _Pending(inc.job, inc.step, self._clock() + self.config.straggler_deadline_s)
            while len(self._pending) > self.config.max_pending:
                self._close(next(iter(self._pending)), "too many open incidents; closed early")
        p.incidents[inc.rank] = inc
        self._check(key)

    def poll(self) -> int:
        """Close the incidents whose deadline passed; returns how many are still open."""
        now = self._clock()
        for key in [k for k, p in self._pending.items() if p.deadline <= now]:
            self._close(key, "")
        return len(self._pending)

    def pending_jobs(self) -> set[str]:
        """The jobs with an incident still open (their state must not be forgotten yet)."""
        return {p.job for p in self._pending.values()}

    def forget(self, ranks: Iterable[tuple[str, int]] = (), jobs: Iterable[str] = ()) -> None:
        """Drop what is kept for these (job, rank) pairs and whole jobs: they ended (the agent's
        ``job_retention_s``). A job with an open incident keeps everything until it closes."""
        busy = self.pending_jobs()
        for job, rank in ranks:
            if job not in busy:
                self._recent.pop((job, rank), None)
                self._seen.get(job, set()).discard(rank)
        gone = set(jobs) - busy
        if gone:
            for job in gone:
                self._world.pop(job, None)
                self._seen.pop(job, None)
            for key in [k for k in self._recent if k[0] in gone]:
                del self._recent[key]

    def close_all(self, note: str = "the agent shut down before every rank reported") -> None:
        for key in list(self._pending):
            self._close(key, note)

    def _expected(self, job: str, job_scope: bool = False) -> tuple[int, ...]:
        """The ranks whose step records an incident waits for. A job-scope incident (localized across
        the ranks by the job's monitors) already holds the whole job: it waits only for the ranks that
        talk to this agent (all of them with a daemon; rank 0 alone in embedded mode)."""
        seen = self._seen.get(job, set())
        if job_scope:
            return tuple(sorted(seen))
        return tuple(sorted(set(range(self._world.get(job, 0))) | seen))

    @staticmethod
    def _job_scope(p: _Pending) -> bool:
        return any(f.scope == "job" for f in p.incidents.values())

    def _views(self, job: str, step: int) -> dict[int, RankView]:
        views = {}
        for rank in self._seen.get(job, ()):
            v = self._recent.get((job, rank), {}).get(step)
            if v is not None:
                views[rank] = v
        return views

    def _check(self, key: tuple[str, int]) -> None:
        p = self._pending.get(key)
        if p is not None and set(self._expected(p.job, self._job_scope(p))) <= set(self._views(p.job, p.step)):
            self._close(key, "")

    def _close(self, key: tuple[str, int], note: str) -> None:
        p = self._pending.pop(key)
        inc = merge_incident(p.job, p.step, self._expected(p.job, self._job_scope(p)), self._views(p.job, p.step),
                             p.incidents, incident_id=self._id(p), trace_id=self._new_trace_id(),
                             closed_unix=time.time(), note=note, world_size=self._world.get(p.job, 0),
                             history=self._history(p))
        self._emit(inc)

    def _id(self, p: _Pending) -> str:
        """:func:`headline_id`, unless a recent incident of another (job, step) already has that id (a client
        that reuses ids): then a fresh one, the finding's id an alias of it."""
        incident_id = headline_id(p.incidents)
        if self._given.get(incident_id, (p.job, p.step)) != (p.job, p.step):
            incident_id = uuid.uuid4().hex
        self._given[incident_id] = (p.job, p.step)
        while len(self._given) > 4096:
            self._given.popitem(last=False)
        return incident_id

    def _history(self, p: _Pending) -> tuple[StepPoint, ...]:
        """The recent steps (at most ``history_steps``) of the lowest rank that sent a finding: the
        incident page's chart of the norm, the loss and the detector's band around the incident."""
        if not p.incidents:
            return ()
        rank = min(p.incidents)
        ring = self._recent.get((p.job, rank), {})
        return tuple(StepPoint(rank=rank, step=step, global_norm=v.global_norm, loss=v.loss, norm_mean=v.norm_mean,
                               norm_threshold=v.norm_threshold) for step, v in sorted(ring.items()))


def headline_id(findings: Mapping[int, Incident]) -> str:
    """The correlated incident's id: the id the lowest reporting rank's trainer printed for its finding
    (``StepReport.incident.incident_id``; rank 0 of a job, the only finding of a job-scope or one-process
    incident), so the trainer, the store, the CLI, the API, the page and the trace all show one id. The
    other ranks' finding ids stay aliases (gradloc/store/aliases.py). A fresh id without a finding, or when
    that finding's id is not 32 lowercase hex digits (what the trainer makes; the store's documented form)."""
    ids = [findings[r].incident_id for r in sorted(findings)]
    ids = [i for i in ids[:1] if _HEX32.fullmatch(i)]
    return ids[0] if ids else uuid.uuid4().hex
