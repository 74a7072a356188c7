"""The telemetry state every exporter reads: latest step per rank, counters, histograms, exemplars.

Ingest writes here (cheap: a dict assignment and a few counter bumps per record); exporters read a
:class:`~gradloc.exporters.snapshot.TelemetrySnapshot` at scrape/export time, so a slow scrape never slows ingest and the cost
of rendering 256 layers × N ranks is paid once per scrape, not once per record.

Cardinality is bounded: at most ``max_series`` (job, rank) pairs and ``max_layers`` layer labels
per rank; records beyond a bound still count in the counters but their series are dropped and
counted (``gradloc_agent_series_dropped_total``). Ranks silent for ``stale_after_s`` leave the
gauges (a finished job must not report its last norm forever); counters stay until the agent
forgets the rank or its job (:meth:`TelemetryState.forget`, after the agent's ``job_retention_s``).
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Iterable

from gradloc.exporters.histogram import Hist as _Hist
from gradloc.exporters.metric_specs import BY_KEY, MetricSpec
from gradloc.exporters.snapshot import (
    JOB_KEYS,
    JOB_RANK,
    RANK_KEYS,
    WINDOW_READERS,
    CounterPoint,
    Exemplar,
    HistogramPoint,
    Labels,
    RankPoint,
    TelemetrySnapshot,
    norm_hist_labels,
    widen_window,
)
from gradloc.exporters.source_labels import SourceLabels
from gradloc.exporters.state_config import StateConfig
from gradloc.records import SampleInfo
from gradloc.records.events import labelled
from gradloc.records.groups import NO_SOURCE, GroupKind, GroupTokens
from gradloc.reports import CorrelatedIncident, StepSummary


def _spec(key: str) -> MetricSpec:
    spec = BY_KEY.get(key)
    if spec is None:
        raise ValueError(f"no metric spec {key!r} (see gradloc/exporters/metric_specs.py)")
    return spec


class TelemetryState:
    """Thread-safe; ingest threads call ``observe_*``/``count``, exporters call ``snapshot``."""

    def __init__(self, config: StateConfig | None = None) -> None:
        self.config = config or StateConfig()
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, str], RankPoint] = {}  # (job, rank label)
        self._counters: dict[tuple[str, Labels], float] = {}
        self._exemplars: dict[tuple[str, Labels], Exemplar] = {}
        self._hists: dict[tuple[str, Labels], _Hist] = {}
        self._pending = self._queued = 0
        self._sources = SourceLabels(self.config.sources, self.config.max_sources)
        # reader -> (job, rank label) -> window key -> max since that reader's previous snapshot
        self._windows: dict[str, dict[tuple[str, str], dict[str, float]]] = {r: {} for r in WINDOW_READERS}

    # -- ingest side -------------------------------------------------------------------------
    def observe_step(self, s: StepSummary, received_unix: float | None = None) -> None:
        now = time.time() if received_unix is None else received_unix
        jr = (s.job, str(s.rank))
        with self._lock:
            self._bump("steps", jr)
            if s.skipped:
                self._bump("skipped_steps", jr)
            hist = norm_hist_labels(s)
            if s.nonfinite and hist is not None:
                self._bump("nonfinite_steps", hist)
            if math.isfinite(s.global_norm) and hist is not None:
                self._hist("norm_hist", hist).observe(s.global_norm)
            self._hist("ingest_lag", ()).observe(max(0.0, now - s.time_unix))
            if s.rl is not None:
                self._observe_rl(s)
            if s.samples is not None:
                self._observe_samples(s)
            for f in s.precursor_findings:  # by closed sets only: never the layer, step or sample (cardinality)
                self._bump("precursor_findings", (s.job, str(s.rank), f.statistic, str(f.trend), str(f.pages).lower()))
            self._store_rank(s, now)

    def _observe_samples(self, s: StepSummary) -> None:
        st = s.samples
        assert st is not None
        if st.z_counts:
            self._hist("sample_surprise_z", (s.job,)).add_counts(st.z_counts, st.z_sum)
        if st.flagged:
            self._bump("sample_outliers", (s.job, str(s.rank), "surprise"), n=st.flagged)
        for o in st.outliers:
            if o.kind != "surprise":  # surprise outliers are counted by st.flagged (the list is capped)
                self._bump("sample_outliers", (s.job, str(s.rank), o.kind))
            else:  # by source: the outliers the step carries (at most SampleConfig.max_outliers of them)
                self._flag_source(s.job, o.sample_info, "outlier")

    def _observe_rl(self, s: StepSummary) -> None:
        rl, job = s.rl, (s.job,)
        assert rl is not None
        if rl.log_ratio_counts:
            self._hist("rl_log_ratio", job).add_counts(rl.log_ratio_counts, rl.log_ratio_sum)
        if rl.advantage_counts:
            self._hist("rl_advantage", job).add_counts(rl.advantage_counts, rl.advantage_sum)

    def _store_rank(self, s: StepSummary, now: float) -> None:
        if not s.layers_global:
            self._store_point((s.job, str(s.rank)), s, now, "all")
            return
        self._store_point((s.job, str(s.rank)), s, now, "rank")
        if s.rank == 0:
            self._store_point((s.job, JOB_RANK), s, now, "job")

    def _store_point(self, key: tuple[str, str], s: StepSummary, now: float, scope: str) -> None:
        if key not in self._ranks and len(self._ranks) >= self.config.max_series:
            self._expire(now)
            if len(self._ranks) >= self.config.max_series:
                self._bump("series_dropped", ("max_series",))
                return
        n = min(len(s.layers), self.config.max_layers) if scope != "rank" else 0
        if scope != "rank" and n < len(s.layers):
            self._bump("series_dropped", ("max_layers",))
        pre = min(len(s.precursors), self.config.max_layers) if scope != "job" else 0
        if pre < len(s.precursors) and scope != "job":
            self._bump("series_dropped", ("max_layers",))
        self._ranks[key] = RankPoint(s, now, n, scope, precursors_exported=pre)
        for windows in self._windows.values():
            widen_window(windows.setdefault(key, {}), s)

    def observe_incident(self, inc: CorrelatedIncident, now: float | None = None) -> None:
        """Count a closed incident; its trace id becomes the exemplar of the spike metrics."""
        now = time.time() if now is None else now
        ex = Exemplar(inc.trace_id, 1.0, now)
        with self._lock:
            self._bump("incidents", (inc.job, inc.status), exemplar=ex)
            if inc.ranks_missing:
                self._bump("missing_ranks", (inc.job,), n=len(inc.ranks_missing))
            for f in inc.findings:
                for kind in f.spike.kinds:
                    self._bump("spikes", (inc.job, str(f.rank), kind), exemplar=ex)
                if f.localization is not None:
                    self._bump("localizations", (inc.job, f.localization.status))
                if f.classification is not None:
                    self._bump("incident_classes", (inc.job, f.classification.kind))
                if f.remedy is not None:
                    self._bump("remedies", (inc.job, f.remedy.action, "true" if f.remedy.applied else "false"))
            for rs in inc.spans:
                self._flag_source(inc.job, rs.span.sample_info, "culprit")
            self._hist("probes", (inc.job,)).observe(float(inc.probes))
            if inc.explained_share is not None and math.isfinite(inc.explained_share):
                # ⟨∇_C, ∇⟩/‖∇‖² can dip below 0 for a culprit set pointing against the rest: clamp.
                self._hist("explained", (inc.job,)).observe(min(1.0, max(0.0, inc.explained_share)))
            if math.isfinite(inc.global_norm):
                job_scope = any(f.scope == "job" for f in inc.findings)
                for rank in (JOB_RANK,) if job_scope else map(str, inc.ranks_reported):
                    self._hist("norm_hist", (inc.job, rank)).exemplify(
                        inc.global_norm, Exemplar(inc.trace_id, inc.global_norm, now))

    def count(self, key: str, labels: Labels = (), n: float = 1) -> None:
        """Bump a counter (self-metrics: rejections, export failures and drops)."""
        with self._lock:
            self._bump(key, labels, n=n)

    def set_cumulative(self, key: str, labels: Labels, value: float) -> None:
        """Set a counter from a cumulative value reported elsewhere (trainer-side client drops).

        A smaller value than before means the reporter restarted: add it on top, counters never go down.
        """
        if len(labels) != len(_spec(key).labels):
            raise ValueError(f"{key}: {len(labels)} label value(s) given, the spec has {len(_spec(key).labels)}")
        with self._lock:
            self._set_cumulative(key, labels, value)

    def observe_events(self, job: str, rank: int, events: Iterable[tuple[str, int]], dropped: int = 0) -> None:
        """A rank's monitor event counts (``StepRecord.events``: cumulative since its monitor started).

        Names outside the declared set (gradloc/records/events.py) are summed into ``event="other"``; each
        label is a cumulative value like the client drops (a restarted trainer's counts add on top).
        ``dropped``: entries the wire decoder refused (``series_dropped{reason="monitor_events"}``)."""
        with self._lock:
            for label, n in labelled(events).items():
                self._set_cumulative("monitor_events", (job, str(rank), label), float(n))
            if dropped:
                self._bump("series_dropped", ("monitor_events",), n=dropped)

    def observe_dropped(self, reason: str, n: int) -> None:
        """Entries of a step the wire decoder refused (``series_dropped{reason}``): monitor_events, data_groups,
        precursors, precursor_findings."""
        with self._lock:
            self._bump("series_dropped", (reason,), n=n)

    def observe_groups(self, job: str, groups: Iterable[GroupTokens], dropped: int = 0) -> None:
        """A step's loss tokens per source (``gradloc_source_tokens_total``); ``dropped``: invalid groups the wire
        decoder refused (``series_dropped{reason="data_groups"}``)."""
        with self._lock:
            for g in groups:
                if g.kind == GroupKind.SOURCE:
                    self._bump("source_tokens", (job, self._sources.label(g.name)), n=g.tokens)
            if dropped:
                self._bump("series_dropped", ("data_groups",), n=dropped)

    def _flag_source(self, job: str, info: SampleInfo | None, kind: str) -> None:
        source = (info.source if info else None) or NO_SOURCE
        self._bump("source_flags", (job, self._sources.label(source), kind))

    def _set_cumulative(self, key: str, labels: Labels, value: float) -> None:
        k = (key, labels)
        base = self._counters.get((key + "#base", labels), 0.0)
        last = self._counters.get((key + "#last", labels), 0.0)
        if value < last:
            base += last
        self._counters[(key + "#base", labels)] = base
        self._counters[(key + "#last", labels)] = value
        self._counters[k] = base + value

    def set_pending(self, n: int, queued: int | None = None) -> None:
        """The agent's own gauges: incidents waiting for stragglers, and batches queued for the pipeline."""
        with self._lock:
            self._pending = n
            if queued is not None:
                self._queued = queued

    def _bump(self, key: str, labels: Labels, n: float = 1, exemplar: Exemplar | None = None) -> None:
        want = len(_spec(key).labels)
        if len(labels) != want:
            raise ValueError(f"{key}: {len(labels)} label value(s) given, the spec has {want}")
        k = (key, labels)
        self._counters[k] = self._counters.get(k, 0.0) + n
        if exemplar is not None:
            self._exemplars[k] = exemplar

    def _hist(self, key: str, labels: Labels) -> _Hist:
        h = self._hists.get((key, labels))
        if h is None:
            h = self._hists[(key, labels)] = _Hist(BY_KEY[key].buckets)
        return h

    def forget(self, ranks: Iterable[tuple[str, str]] = (), jobs: Iterable[str] = ()) -> int:
        """Drop every series of these (job, rank label) pairs and of these whole jobs: gauges,
        counters, histograms and their exemplars. For ranks and jobs that ended (the agent calls it
        after ``job_retention_s`` of silence); a rank that comes back starts its counters from 0,
        which Prometheus reads as a counter reset. Returns how many counters and histograms went."""
        ranks, jobs = set(ranks), set(jobs)
        if not ranks and not jobs:
            return 0

        def gone(key: str, labels: Labels) -> bool:
            base = key.partition("#")[0]  # "client_dropped#last" is client_dropped's bookkeeping
            if base in JOB_KEYS and labels[0] in jobs:
                return True
            return base in RANK_KEYS and (labels[0], labels[1]) in ranks

        n = 0
        with self._lock:
            for d in (self._counters, self._hists, self._exemplars):
                doomed = [k for k in d if gone(*k)]
                for k in doomed:
                    del d[k]
                n += len(doomed) if d is not self._exemplars else 0
            for k in [k for k in self._ranks if k in ranks or k[0] in jobs]:
                self._drop_rank(k)
        return n

    def _drop_rank(self, key: tuple[str, str]) -> None:
        del self._ranks[key]
        for windows in self._windows.values():
            windows.pop(key, None)

    def _expire(self, now: float) -> None:
        cutoff = now - self.config.stale_after_s
        for key in [k for k, p in self._ranks.items() if p.received_unix < cutoff]:
            self._drop_rank(key)

    # -- export side -------------------------------------------------------------------------
    def snapshot(self, now: float | None = None, reader: str | None = None) -> TelemetrySnapshot:
        """The state now. ``reader`` (one of WINDOW_READERS: the exporter collecting) gets, and empties, its
        own windows: each rank's window maxima (``gradloc_grad_global_norm_max``...) over the steps since that
        reader's previous snapshot; a rank with no step since shows its latest step's values, never 0. Without
        ``reader`` no window is read or emptied (the window gauges show the latest step's values)."""
        now = time.time() if now is None else now
        if reader is not None and reader not in self._windows:
            raise ValueError(f"unknown snapshot reader {reader!r} (one of {', '.join(WINDOW_READERS)})")
        with self._lock:
            self._expire(now)
            windows = self._windows[reader] if reader is not None else {}
            if reader is not None:
                self._windows[reader] = {}
            ranks = tuple(dataclasses.replace(p, window_max=tuple(windows[k].items())) if windows.get(k) else p
                          for k, p in self._ranks.items())
            counters = tuple(CounterPoint(key, labels, v, self._exemplars.get((key, labels)))
                             for (key, labels), v in self._counters.items() if "#" not in key)
            hists = tuple(HistogramPoint(key, labels, tuple(h.counts), h.sum, h.count, tuple(h.exemplars))
                          for (key, labels), h in self._hists.items())
            pending, queued = self._pending, self._queued
        return TelemetrySnapshot(now, ranks, counters, hists, pending, queued)

