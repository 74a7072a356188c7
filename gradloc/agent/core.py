"""The agent pipeline after ingest: telemetry state → correlator → store / OTLP, on one worker thread.

The same core runs inside the daemon (fed by the gRPC ingest threads) and inside the training
process in embedded mode (fed by the Monitor's sink). Producers only enqueue; the worker owns the
correlator (single-threaded), writes step summaries to the store in batches and hands closed
incidents to the store, the OTLP exporter and the telemetry state. Nothing is dropped silently:
a full queue is the producer's answer (``submit`` returns False) and each producer counts it.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from gradloc.agent.activity import Activity
from gradloc.agent.correlator import Correlator, CorrelatorConfig
from gradloc.agent.quarantine_policy import QuarantinePolicy, incident_entries, outlier_entries
from gradloc.errors import ConfigError
from gradloc.exporters.state import StateConfig, TelemetryState
from gradloc.records import Incident, StepRecord
from gradloc.reports import CorrelatedIncident, StepSummary, summarize

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Declare:
    """A client's identity (from a batch header): job, rank and the job's world size."""

    job: str
    rank: int
    world_size: int


@dataclass(frozen=True)
class Journaled:
    """A rank incident already committed to the store's inbox under ``key`` (gradloc/store/inbox.py):
    the correlated incident that holds it marks that row done when it is stored."""

    incident: Incident
    key: tuple[str, int, int]


@dataclass(frozen=True)
class DropReport:
    """Cumulative drop counters a trainer-side client reported."""

    job: str
    rank: int
    counts: tuple[tuple[str, int], ...]


_ITEMS = (StepSummary, Incident, Journaled, Declare, DropReport)  # what submit takes (StepRecord: summarized)


class IncidentSink(Protocol):
    def on_step(self, summary: StepSummary) -> None: ...

    def on_incident(self, inc: CorrelatedIncident) -> None: ...


@dataclass(frozen=True)
class CoreConfig:
    queue_size: int = 1024  # queued submissions (one submission = one ingest batch)
    store_batch: int = 512  # step summaries per store transaction at most (each holds its layer columns)
    retention_interval_s: float = 300.0
    recent_incidents: int = 256  # kept in memory for the API when there is no store
    job_retention_s: float = 3600.0  # a (job, rank) silent this long has ended: its state is forgotten
    correlator: CorrelatorConfig = field(default_factory=CorrelatorConfig)
    state: StateConfig = field(default_factory=StateConfig)
    quarantine: QuarantinePolicy = field(default_factory=QuarantinePolicy)  # samples kept out by policy

    def __post_init__(self) -> None:
        if self.queue_size < 1 or self.store_batch < 1 or self.recent_incidents < 0:
            raise ConfigError("queue_size and store_batch must be >= 1, recent_incidents >= 0")
        if not self.retention_interval_s > 0 or not self.job_retention_s > 0:
            raise ConfigError("retention_interval_s and job_retention_s must be > 0")


class AgentCore:
    def __init__(self, config: CoreConfig | None = None, store: Any = None,
                 exporters: Iterable[Any] = (), new_trace_id: Callable[[], str] | None = None,
                 inbox_owner: str = "daemon", clock: Callable[[], float] = time.time) -> None:
        from gradloc.exporters.ids import new_trace_id as default_trace_id

        self.config = config or CoreConfig()
        self._clock = clock  # wall time: when items arrive, and when a silent job is forgotten
        self.activity = Activity()
        self._next_forget = 0.0
        self.state = TelemetryState(self.config.state)
        self.store, self.exporters = store, list(exporters)
        self.correlator = Correlator(self._on_correlated, self.config.correlator,
                                     new_trace_id or default_trace_id)
        self.recent: deque[CorrelatedIncident] = deque(maxlen=self.config.recent_incidents)
        self.recent_outliers: deque[Any] = deque(maxlen=self.config.recent_incidents)  # SampleOutlier, for the API without a store
        self.recent_precursors: deque[Any] = deque(maxlen=self.config.recent_incidents)  # PrecursorFinding, likewise
        self._q: queue.Queue[tuple[float, list[Any]] | None] = queue.Queue(self.config.queue_size)
        self._idle = threading.Condition()
        self._unfinished = 0
        self._steps: list[StepSummary] = []
        self._thread: threading.Thread | None = None
        self._next_retention = 0.0
        # (job, step, rank) -> the inbox rows of the incidents fed to the correlator for it since its last
        # close (worker only). The correlator keeps one incident per rank and step (a later one replaces
        # an earlier); the replaced one's row is settled with the incident that replaced it, or every
        # restart would correlate it again and store it once more.
        self._inbox_keys: dict[tuple[str, int, int], list[tuple[str, int, int]]] = {}
        self.inbox_owner = inbox_owner  # whose open inbox rows start() correlates again (gradloc/store/inbox.py)

    # -- producers ---------------------------------------------------------------------------
    def start(self) -> "AgentCore":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gradloc-agent-core", daemon=True)
            self._thread.start()
            self._replay_inbox()
        return self

    def _replay_inbox(self) -> None:
        """Feed the correlator the incidents a previous run acknowledged but never stored (a crash)."""
        pending = getattr(self.store, "inbox_pending", None)
        if pending is None:
            return
        from gradloc.store.incident_json import incident_from_json

        items: list[Any] = []
        try:
            rows = pending(self.inbox_owner)
        except Exception:  # noqa: BLE001 - counted; the agent still starts
            log.exception("gradloc agent: reading the inbox failed")
            self.state.count("export_failures", ("store",))
            return
        for key, (job, rank, world), payload in rows:
            try:
                items += [Declare(job, rank, world), Journaled(incident_from_json(payload), key)]
            except ValueError:
                log.exception("gradloc agent: inbox row %s is not an incident; left in place", key)
        if items:
            log.info("gradloc agent: %d acknowledged incident(s) from before a restart are correlated again",
                     len(items) // 2)
            self.submit(items, timeout_s=60.0)

    def submit(self, items: list[Any], timeout_s: float | None = None) -> bool:
        """Enqueue items (StepSummary, StepRecord, Incident, Declare, DropReport). False when full."""
        with self._idle:
            self._unfinished += 1
        try:
            entry = (self._clock(), items)
            self._q.put(entry, block=timeout_s is not None and timeout_s > 0, timeout=timeout_s or None)
            return True
        except queue.Full:
            self._done()
            return False

    @property
    def queued(self) -> int:
        return self._q.qsize()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything submitted so far is processed (and step summaries are stored)."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._unfinished:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Process what is queued, close open incidents as partial, flush exporters, stop."""
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout_s  # one budget for all of it: a stop never waits twice

        def left() -> float:
            return max(0.5, deadline - time.monotonic())

        if not self.flush(left()):
            log.warning("gradloc agent: %d queued batch(es) not processed within the %.0f s close budget",
                        self._unfinished, timeout_s)
        self._q.put(None)
        self._thread.join(left())
        self._thread = None
        self._guard("store", self._close_store)
        for exp in self.exporters:
            self._guard("exporter", exp.force_flush, left())
            self._guard("exporter", exp.shutdown)

    # -- worker ------------------------------------------------------------------------------
    def _done(self) -> None:
        with self._idle:
            self._unfinished -= 1
            if not self._unfinished:
                self._idle.notify_all()

    def _run(self) -> None:
        while True:
            try:
                entry = self._q.get(timeout=0.2)
            except queue.Empty:
                entry = ()
            if entry is None:
                self.correlator.close_all()
                self._write_steps()
                return
            if entry:
                self._handle(*entry)
            self._guard("worker", self._housekeeping, bool(entry))

    def _handle(self, received: float, items: list[Any]) -> None:
        try:
            for item in items:
                self._guard("worker", self._item, item, received)
        finally:
            if len(self._steps) >= self.config.store_batch or self._q.empty():
                self._write_steps()
            self._done()

    def _item(self, item: Any, received: float) -> None:
        if isinstance(item, StepRecord):
            item = summarize(item)
        if not isinstance(item, _ITEMS):
            raise TypeError(f"unknown item {type(item).__name__}")
        who = item.incident if isinstance(item, Journaled) else item
        self.activity.touch(who.job, who.rank, received)
        if isinstance(item, StepSummary):
            self.state.observe_step(item, received)
            if item.events or item.events_dropped:
                self.state.observe_events(item.job, item.rank, item.events, item.events_dropped)
            if item.groups or item.groups_dropped:
                self.state.observe_groups(item.job, item.groups, item.groups_dropped)
            if item.precursors_dropped:
                self.state.observe_dropped("precursors", item.precursors_dropped)
            if item.precursor_findings_dropped:
                self.state.observe_dropped("precursor_findings", item.precursor_findings_dropped)
            if item.samples is not None:
                self.recent_outliers.extend(item.samples.outliers)
            self.recent_precursors.extend(item.precursor_findings)
            self.correlator.on_step(item)
            self._steps.append(item)
            for exp in self.exporters:
                self._guard("exporter", exp.on_step, item)
        elif isinstance(item, Incident):
            self.correlator.on_incident(item)
        elif isinstance(item, Journaled):
            inc = item.incident
            self._inbox_keys.setdefault((inc.job, inc.step, inc.rank), []).append(item.key)
            self.correlator.on_incident(inc)
        elif isinstance(item, Declare):
            self.correlator.declare(item.job, item.rank, item.world_size)
        else:  # DropReport
            for reason, n in item.counts:
                self.state.set_cumulative("client_dropped", (item.job, str(item.rank), reason), n)

    def _housekeeping(self, busy: bool) -> None:
        self.state.set_pending(self.correlator.poll(), self._q.qsize())
        now_unix = self._clock()
        if now_unix >= self._next_forget:
            self._next_forget = now_unix + min(self.config.job_retention_s / 10, 60.0)
            self._forget(now_unix)
        now = time.monotonic()
        if self.store is not None and now >= self._next_retention and not busy:
            self._next_retention = now + self.config.retention_interval_s
            for rule, n in self.store.apply_retention().items():  # the store's limits, counted
                if n:
                    self.state.count("retention_deleted", (rule,), n)

    def _forget(self, now: float) -> None:
        """Forget the ranks and jobs silent for ``job_retention_s`` (not while an incident is open)."""
        ranks, jobs = self.activity.expire(now - self.config.job_retention_s, self.correlator.pending_jobs())
        if ranks or jobs:
            self.correlator.forget(ranks, jobs)
            self.state.forget([(job, str(rank)) for job, rank in ranks], jobs)
            log.debug("gradloc agent: forgot %d rank(s) and %d job(s) silent for %.0f s",
                      len(ranks), len(jobs), self.config.job_retention_s)

    def _write_steps(self) -> None:
        steps, self._steps = self._steps, []
        if steps and self.store is not None:
            try:
                self.store.put_steps(steps)
                self._quarantine(outlier_entries(self.config.quarantine, steps, self._clock()))
            except Exception:  # noqa: BLE001 - counted, never fatal
                log.exception("gradloc: storing %d step summaries failed", len(steps))
                self.state.count("export_failures", ("store",))
                self.state.count("export_dropped", ("store",), n=len(steps))

    def _on_correlated(self, inc: CorrelatedIncident) -> None:
        self.recent.append(inc)
        self.state.observe_incident(inc)
        if self.store is not None:
            keys = [k for f in inc.findings for k in self._inbox_keys.pop((f.job, f.step, f.rank), ())]
            self._guard("store", self._put_incident, inc, keys)
        for exp in self.exporters:
            self._guard("exporter", exp.on_incident, inc)

    def _put_incident(self, inc: CorrelatedIncident, keys: list[tuple[str, int, int]]) -> None:
        if keys:
            self.store.put_incident(inc, inbox_keys=keys)
        else:
            self.store.put_incident(inc)
        self._quarantine(incident_entries(self.config.quarantine, inc, self._clock()))

    def _quarantine(self, entries: list[Any]) -> None:
        if entries and hasattr(self.store, "quarantine"):
            self.store.quarantine.add(entries)

    def _close_store(self) -> None:
        if self.store is not None:
            self.store.close()

    def _guard(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - one bad item or exporter must not stop the pipeline
            log.exception("gradloc agent: %s failed", what)
            self.state.count("export_failures", (what,))
