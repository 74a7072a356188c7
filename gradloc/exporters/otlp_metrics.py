"""OTel instruments for every metric in :data:`~gradloc.exporters.metric_specs.SPECS`.

Where each value comes from, and why:

* **Gauges** are observable gauges read from one :meth:`TelemetryState.snapshot` per collection:
  the state already holds the latest step of each rank (bounded, stale ranks expired), so the OTLP
  view and the Prometheus scrape show the same numbers and nothing is re-aggregated per record.
* **Window maxima** (``gradloc.grad.global_norm_max``, ``gradloc.loss_max``) are observable gauges too,
  from the same snapshot taken as reader "otlp": the largest value over the steps since the previous OTLP
  collection (the latest step's value when none arrived), kept apart from the Prometheus scrape's windows so
  neither exporter empties the other's. Chosen over a histogram: the step-norm histogram is already exported
  (``gradloc.step.grad_norm``) but gives a spike only to its bucket's bound; the gauge gives the value.
* **Counters** are observable counters reporting the state's cumulative values — except
  ``gradloc.incident.count`` and ``gradloc.spike.count``, which are synchronous counters added in
  ``on_incident`` *inside the incident's root span*: the SDK's trace-based exemplar filter then
  attaches an exemplar carrying the incident's trace id (OTel has no way to attach an exemplar to an
  observation). Those two come from the synchronous counters only, never from the snapshot, so they
  are not counted twice.
* **Histograms** have no observable form in OTel: they are recorded in ``on_step``/``on_incident``
  with explicit bucket boundaries from the spec (Views; never exponential buckets). The exception
  are *pre-aggregated* histograms (``MetricSpec.preaggregated``: the RL distributions), which the
  trainer sends as bucket counts, not values: OTel's API cannot record counts, so each export gets
  their cumulative points, built from the state's counts, added next to the SDK's metrics
  (:func:`with_preaggregated`; no min/max, which counts do not give, and no sum for histograms with
  negative buckets, as OTLP and OpenMetrics ask).

Attribute values are strings (``rank="3"``), like the Prometheus labels, so both paths agree.

Non-finite values: SDK 1.45 drops every NaN/±Inf measurement (gauges included) with a warning, so a
NaN layer norm cannot travel over OTLP as it does in the Prometheus scrape. We leave those points out
ourselves (no warning per collection); non-finite gradients stay visible through
``gradloc.grad.nonfinite`` (elements, per rank) and ``gradloc.step.nonfinite`` (steps).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

from gradloc.exporters.metric_specs import AGENT_GAUGES, SPECS, MetricSpec
from gradloc.exporters.precursor_series import PRECURSOR_KEYS, precursor_points
from gradloc.exporters.snapshot import (
    RANK_GAUGES,
    CounterPoint,
    RankPoint,
    TelemetrySnapshot,
    norm_hist_labels,
    rl_ratio_values,
    shed_values,
)
from gradloc.exporters.state import TelemetryState
from gradloc.reports import CorrelatedIncident, LayerColumns, StepSummary

log = logging.getLogger(__name__)

EXPORTER = "otlp_metrics"
SYNC_COUNTERS = frozenset({"incidents", "spikes"})
"""Counter keys recorded synchronously (with exemplars) instead of read from the snapshot."""

_LAYER_GAUGES: dict[str, Callable[[LayerColumns], np.ndarray]] = {
    "layer_norm": lambda c: c.grad_norm,
    "layer_max_abs": lambda c: c.grad_max_abs,
    "update_ratio": lambda c: c.update_ratio,  # NaN = no ratio known
}


def histogram_views() -> list[View]:
    """One View per histogram spec: explicit boundaries from the spec."""
    return [View(instrument_name=s.otel, aggregation=ExplicitBucketHistogramAggregation(
        boundaries=[float(b) for b in s.buckets])) for s in SPECS if s.kind == "histogram" and not s.preaggregated]


def with_preaggregated(data: MetricsData, snap: TelemetrySnapshot, start_ns: int) -> MetricsData:
    """``data`` with the pre-aggregated histograms' cumulative points added to its first scope."""
    metrics = []
    for spec in SPECS:
        if not spec.preaggregated:
            continue
        points = [HistogramDataPoint(
            attributes=dict(zip(spec.labels, h.labels)), start_time_unix_nano=start_ns,
            time_unix_nano=int(snap.time_unix * 1e9), count=h.count,
            sum=h.sum if math.isfinite(h.sum) and spec.buckets[0] >= 0 else None, bucket_counts=list(h.counts),
            explicit_bounds=[float(b) for b in spec.buckets], min=None, max=None, exemplars=[])
            for h in snap.histograms if h.key == spec.key]
        if points:
            metrics.append(Metric(spec.otel, spec.help, spec.unit, Histogram(points, AggregationTemporality.CUMULATIVE)))
    if not metrics or not data.resource_metrics or not data.resource_metrics[0].scope_metrics:
        return data
    rm = data.resource_metrics[0]
    sm = dataclasses.replace(rm.scope_metrics[0], metrics=[*rm.scope_metrics[0].metrics, *metrics])
    rm = dataclasses.replace(rm, scope_metrics=[sm, *rm.scope_metrics[1:]])
    return dataclasses.replace(data, resource_metrics=[rm, *data.resource_metrics[1:]])


class CountingMetricExporter(MetricExporter):
    """Delegates to the OTLP metric exporter; counts FAILURE results and exceptions into the state."""

    def __init__(self, inner: MetricExporter, state: TelemetryState) -> None:
        super().__init__(preferred_temporality=inner._preferred_temporality,
                         preferred_aggregation=inner._preferred_aggregation)
        self._inner, self._state = inner, state
        self.failures = 0
        self._start_ns = time.time_ns()

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        try:
            metrics_data = with_preaggregated(metrics_data, self._state.snapshot(), self._start_ns)
        except Exception:  # the SDK's own metrics still go out
            log.warning("OTLP: adding the pre-aggregated histograms failed", exc_info=True)
            self._state.count("export_failures", (EXPORTER,))
        try:
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:
            log.warning("OTLP metric export raised", exc_info=True)
            result = MetricExportResult.FAILURE
        if result is not MetricExportResult.SUCCESS:
            self.failures += 1
            self._state.count("export_failures", (EXPORTER,))
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


class _SnapshotReader:
    """One state snapshot per collection, shared by every callback of that collection.

    The SDK runs a collection's callbacks in registration order under one lock, so the first
    registered callback refreshes the snapshot and the others reuse it.
    """

    def __init__(self, state: TelemetryState) -> None:
        self._state = state
        self._snap: TelemetrySnapshot | None = None
        self._counters: dict[str, list[CounterPoint]] = {}
        self._lock = threading.Lock()

    def refresh(self) -> TelemetrySnapshot:
        snap = self._state.snapshot(reader="otlp")  # the OTLP export's own window maxima (not the scrape's)
        by_key: dict[str, list[CounterPoint]] = {}
        for c in snap.counters:
            by_key.setdefault(c.key, []).append(c)
        with self._lock:
            self._snap, self._counters = snap, by_key
        return snap

    def current(self) -> TelemetrySnapshot:
        with self._lock:
            snap = self._snap
        return snap if snap is not None else self.refresh()

    def counters(self, key: str) -> list[CounterPoint]:
        self.current()
        with self._lock:
            return self._counters.get(key, [])


def _rank_attrs(p: RankPoint) -> dict[str, str]:
    return {"job": p.summary.job, "rank": p.rank_label}


class MetricInstruments:
    """Creates the instruments on ``meter`` and records the synchronous ones."""

    def __init__(self, meter: Meter, state: TelemetryState) -> None:
        self._reader = _SnapshotReader(state)
        self._sync: dict[str, Any] = {}
        first = True
        for spec in SPECS:
            kw = {"unit": spec.unit, "description": spec.help}
            if spec.preaggregated:
                continue  # exported from the state's counts (with_preaggregated)
            if spec.kind == "histogram":
                self._sync[spec.key] = meter.create_histogram(spec.otel, **kw)
            elif spec.kind == "counter" and spec.key in SYNC_COUNTERS:
                self._sync[spec.key] = meter.create_counter(spec.otel, **kw)
            else:
                create = meter.create_observable_gauge if spec.kind == "gauge" else meter.create_observable_counter
                create(spec.otel, callbacks=[self._callback(spec, refresh=first)], **kw)
                first = False

    def _callback(self, spec: MetricSpec, refresh: bool) -> Callable[[CallbackOptions], Iterable[Observation]]:
        observe = self._observer(spec)

        def callback(options: CallbackOptions) -> list[Observation]:
            snap = self._reader.refresh() if refresh else self._reader.current()
            return observe(snap)
        return callback

    def _observer(self, spec: MetricSpec) -> Callable[[TelemetrySnapshot], list[Observation]]:
        if spec.kind == "counter":
            return lambda snap: [Observation(c.value, dict(zip(spec.labels, c.labels)))
                                 for c in self._reader.counters(spec.key)]
        if spec.key == "shed":
            return lambda snap: [Observation(v, {**_rank_attrs(p), "feature": f})
                                 for p in snap.ranks if p.own for f, v in shed_values(p.summary)]
        if spec.key == "rl_max_abs_log_ratio":
            return lambda snap: [Observation(v, {**_rank_attrs(p), "reference": r}) for p in snap.ranks if p.own
                                 for r, v in rl_ratio_values(p.summary) if math.isfinite(v)]
        if spec.key in RANK_GAUGES:
            return lambda snap: [Observation(v, _rank_attrs(p)) for p in snap.ranks
                                 for k, v in p.gauges() if k == spec.key and math.isfinite(v)]
        if spec.key in _LAYER_GAUGES:
            return lambda snap: _layer_observations(snap, _LAYER_GAUGES[spec.key])
        if spec.key in PRECURSOR_KEYS:
            return lambda snap: [Observation(v, {**_rank_attrs(p), **extra}) for p in snap.ranks
                                 for k, extra, v in precursor_points(p) if k == spec.key]
        if spec.key in AGENT_GAUGES:
            return lambda snap: [Observation(getattr(snap, spec.key))]
        log.warning("no OTLP source for gauge %s: it is not exported", spec.otel)
        return lambda snap: []

    # -- synchronous instruments --------------------------------------------------------------
    def on_step(self, s: StepSummary, now: float) -> None:
        labels = norm_hist_labels(s)
        if math.isfinite(s.global_norm) and labels is not None:
            self._sync["norm_hist"].record(s.global_norm, dict(zip(("job", "rank"), labels)))
        if math.isfinite(s.time_unix):
            self._sync["ingest_lag"].record(max(0.0, now - s.time_unix))

    def on_incident(self, inc: CorrelatedIncident) -> None:
        """Call with the incident's root span current: the measurements get its trace id as exemplar."""
        self._sync["incidents"].add(1, {"job": inc.job, "status": inc.status})
        for f in inc.findings:
            for kind in f.spike.kinds:
                self._sync["spikes"].add(1, {"job": inc.job, "rank": str(f.rank), "kind": kind})
        self._sync["probes"].record(float(inc.probes), {"job": inc.job})
        if inc.explained_share is not None and math.isfinite(inc.explained_share):
            self._sync["explained"].record(inc.explained_share, {"job": inc.job})


def _layer_observations(snap: TelemetrySnapshot, column: Callable[[LayerColumns], np.ndarray]) -> list[Observation]:
    """Finite values of the first ``layers_exported`` layers of every rank (the state's layer bound)."""
    out: list[Observation] = []
    for p in snap.ranks:
        s, n = p.summary, p.layers_exported
        values = column(s.layers)[:n]
        for i in np.flatnonzero(np.isfinite(values)).tolist():
            out.append(Observation(float(values[i]), {**_rank_attrs(p), "layer": s.layers.names[i]}))
    return out
