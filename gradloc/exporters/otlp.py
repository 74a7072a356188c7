"""OTLP/gRPC exporter: gradloc metrics and one trace per correlated incident, to any OTel collector.

Why it is built this way:

* **Own providers, never the global ones.** The training script (or the agent's host) may have set
  up OpenTelemetry for itself; gradloc's MeterProvider/TracerProvider carry their own resource
  (``service.name`` = ``gradloc-agent`` by default) and are shut down by :meth:`OtlpExporter.shutdown`.
* **Never blocks training.** ``on_step``/``on_incident`` only record in memory (histograms, spans
  into a bounded queue); the network is touched by the SDK's periodic metric reader thread and our
  span worker thread. ``force_flush``/``shutdown`` run the SDK calls on a helper thread and wait at
  most their timeout: with the collector down, the SDK's own flush returns True after dropping the
  data, so we report failure ourselves.
* **Nothing is lost silently.** Failed exports are counted in ``export_failures{exporter=
  "otlp_metrics"|"otlp_traces"}``, lost spans in ``export_dropped{exporter="otlp_traces"}``.
* **Seeded training scripts.** Trace/span ids come from ``os.urandom`` (:mod:`gradloc.exporters.ids`):
  ``random.seed(42)`` in a trainer must not make every run's trace ids identical.

The OTLP exporter package is the ``otlp`` extra, imported only when an :class:`OtlpExporter` is built.
"""
from __future__ import annotations

import atexit
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    MeterProvider,
    ObservableCounter,
    ObservableGauge,
    TraceBasedExemplarFilter,
)
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from gradloc.errors import ConfigError
from gradloc.exporters.ids import GradlocIdGenerator
from gradloc.exporters.otlp_metrics import (
    CountingMetricExporter,
    MetricInstruments,
    histogram_views,
)
from gradloc.exporters.otlp_traces import CountingBatchSpanProcessor, emit_incident
from gradloc.exporters.state import TelemetryState
from gradloc.reports import CorrelatedIncident, StepSummary

log = logging.getLogger(__name__)

AttrValue = str | bool | int | float


@dataclass(frozen=True)
class OtlpConfig:
    """Validated OTLP exporter settings. ``endpoint``: ``host:port`` or ``http(s)://host:port``."""

    endpoint: str
    service_name: str = "gradloc-agent"
    export_interval_s: float = 5.0  # metrics export period; also the span batch delay
    timeout_s: float = 5.0  # per export attempt (retries included), and the default flush/shutdown bound
    insecure: bool = True
    headers: tuple[tuple[str, str], ...] = ()
    resource_attributes: tuple[tuple[str, AttrValue], ...] = ()
    max_queue_spans: int = 2048
    max_batch_spans: int = 512

    def __post_init__(self) -> None:
        _check_endpoint(self.endpoint, self.insecure)
        if not isinstance(self.service_name, str) or not self.service_name:
            raise ConfigError("service_name must be a non-empty string")
        for name in ("export_interval_s", "timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if not (1 <= self.max_batch_spans <= self.max_queue_spans):
            raise ConfigError("need 1 <= max_batch_spans <= max_queue_spans")
        object.__setattr__(self, "headers", _check_headers(self.headers))
        object.__setattr__(self, "resource_attributes", _check_resource(self.resource_attributes))


def _check_endpoint(endpoint: str, insecure: bool) -> None:
    if not isinstance(endpoint, str) or not endpoint.strip():
        raise ConfigError("endpoint must be 'host:port' or 'http(s)://host:port'")
    parts = urlsplit(endpoint if "://" in endpoint else "//" + endpoint)
    if parts.scheme not in ("", "http", "https") or not parts.hostname:
        raise ConfigError(f"endpoint {endpoint!r}: expected 'host:port' or 'http(s)://host:port'")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        raise ConfigError(f"endpoint {endpoint!r} needs a port in 1..65535 (OTLP/gRPC default: 4317)")
    if parts.scheme == "https" and insecure:
        raise ConfigError(f"endpoint {endpoint!r} asks for TLS: pass insecure=False")


def _check_headers(headers: Any) -> tuple[tuple[str, str], ...]:
    items = list(headers.items()) if isinstance(headers, Mapping) else list(headers or ())
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            raise ConfigError(f"headers must map str to str, got {item!r}")
        if not item[0] or item[0] != item[0].lower():  # gRPC rejects uppercase metadata keys at call time
            raise ConfigError(f"header name {item[0]!r} must be non-empty lowercase (gRPC metadata)")
    return tuple(items)


def _check_resource(attrs: Any) -> tuple[tuple[str, AttrValue], ...]:
    items = list(attrs.items()) if isinstance(attrs, Mapping) else list(attrs or ())
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and item[0]
                and isinstance(item[1], (str, bool, int, float))):
            raise ConfigError(f"resource_attributes must map names to str/bool/int/float, got {item!r}")
    return tuple(items)


def _import_otlp() -> tuple[type, type]:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter,
        )
    except ImportError as e:
        raise ConfigError(f"the OTLP exporter needs the otlp extra: pip install gradloc[otlp] ({e})") from e
    return OTLPMetricExporter, OTLPSpanExporter


def _bounded(calls: Sequence[Callable[[], Any]], timeout_s: float) -> bool:
    """Run ``calls`` on helper threads; True iff all finished within ``timeout_s`` and none failed."""
    results: list[bool] = []

    def run(fn: Callable[[], Any]) -> None:
        try:
            results.append(fn() is not False)
        except Exception:
            log.warning("OTLP flush/shutdown failed", exc_info=True)
            results.append(False)

    threads = [threading.Thread(target=run, args=(fn,), name="gradloc-otlp-flush", daemon=True) for fn in calls]
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return all(not t.is_alive() for t in threads) and len(results) == len(calls) and all(results)


def _atexit_hook(ref: weakref.ref[OtlpExporter]) -> Callable[[], None]:
    """Shut down at interpreter exit (bounded), without keeping the exporter alive."""
    def hook() -> None:
        exporter = ref()
        if exporter is not None:
            exporter.shutdown()
    return hook


class OtlpExporter:
    """Exports the state's metrics and each correlated incident's trace over OTLP/gRPC.

    ``state`` is fed by the agent (``observe_step``/``observe_incident``); this exporter reads it
    for gauges and counters and records histograms, incident/spike counters and traces itself in
    :meth:`on_step`/:meth:`on_incident`. No method raises or waits on the network past its timeout.
    """

    def __init__(self, state: TelemetryState, endpoint: str | OtlpConfig, *, service_name: str = "gradloc-agent",
                 export_interval_s: float = 5.0, timeout_s: float = 5.0, insecure: bool = True,
                 headers: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
                 resource_attributes: Mapping[str, AttrValue] | None = None,
                 max_queue_spans: int = 2048) -> None:
        """``endpoint`` may also be a ready :class:`OtlpConfig` (the keyword arguments are then ignored)."""
        self.config = c = endpoint if isinstance(endpoint, OtlpConfig) else OtlpConfig(
            endpoint, service_name, export_interval_s, timeout_s, insecure, headers or (),
            resource_attributes or (), max_queue_spans, min(512, max_queue_spans))
        metric_cls, span_cls = _import_otlp()
        self.state = state
        self._closed = False
        self._lock = threading.Lock()
        resource = Resource.create({**dict(c.resource_attributes), SERVICE_NAME: c.service_name})
        self._metric_exporter = CountingMetricExporter(metric_cls(**self._exporter_kwargs()), state)
        self._meter_provider = self._build_meter_provider(resource)
        self._metrics = MetricInstruments(self._meter_provider.get_meter("gradloc"), state)
        self._spans = CountingBatchSpanProcessor(
            span_cls(**self._exporter_kwargs()), state, max_queue=c.max_queue_spans, max_batch=c.max_batch_spans,
            delay_s=c.export_interval_s, shutdown_timeout_s=c.timeout_s)
        self._tracer_provider = TracerProvider(resource=resource, id_generator=GradlocIdGenerator(),
                                               sampler=ALWAYS_ON, shutdown_on_exit=False)
        self._tracer_provider.add_span_processor(self._spans)
        self._tracer = self._tracer_provider.get_tracer("gradloc")
        self._atexit = _atexit_hook(weakref.ref(self))
        atexit.register(self._atexit)

    def _exporter_kwargs(self) -> dict[str, Any]:
        c = self.config
        return {"endpoint": c.endpoint, "insecure": c.insecure, "headers": c.headers or None, "timeout": c.timeout_s}

    def _build_meter_provider(self, resource: Resource) -> MeterProvider:
        c = self.config
        kw = {"export_interval_millis": c.export_interval_s * 1e3, "export_timeout_millis": c.timeout_s * 1e3}
        # The state bounds cardinality (max_series × max_layers); the SDK's default of 2000 points per
        # metric would fold a 256-layer × 8-rank job into an `otel.metric.overflow` point.
        limit = max(2000, self.state.config.max_series * self.state.config.max_layers)
        limits = {cls: limit for cls in (ObservableGauge, ObservableCounter, Counter, Histogram)}
        try:
            reader = PeriodicExportingMetricReader(self._metric_exporter, cardinality_limits=limits, **kw)
        except TypeError:  # SDK without cardinality_limits: its default limit applies
            log.warning("this opentelemetry-sdk cannot raise the metric cardinality limit (2000 points per metric)")
            reader = PeriodicExportingMetricReader(self._metric_exporter, **kw)
        common = {"metric_readers": [reader], "resource": resource, "views": histogram_views(),
                  "shutdown_on_exit": False}
        try:  # explicit: OTEL_METRICS_EXEMPLAR_FILTER=always_off in the environment must not lose exemplars
            return MeterProvider(exemplar_filter=TraceBasedExemplarFilter(), **common)
        except TypeError:  # an SDK without the argument: its default (trace_based, or no exemplars) applies
            return MeterProvider(**common)

    # -- sink API -------------------------------------------------------------------------------
    def on_step(self, summary: StepSummary) -> None:
        if self._closed:
            return
        try:
            self._metrics.on_step(summary, time.time())
        except Exception:
            log.warning("OTLP on_step failed", exc_info=True)
            self.state.count("export_failures", ("otlp_metrics",))

    def on_incident(self, inc: CorrelatedIncident) -> None:
        if self._closed:
            return
        try:
            emit_incident(self._tracer, inc, in_root=lambda: self._metrics.on_incident(inc))
        except Exception:
            log.warning("OTLP on_incident failed for %s", getattr(inc, "incident_id", "?"), exc_info=True)
            self.state.count("export_failures", ("otlp_traces",))

    def force_flush(self, timeout_s: float | None = None) -> bool:
        """Export what is pending; True iff it finished within ``timeout_s`` and no export failed."""
        timeout = self.config.timeout_s if timeout_s is None else max(0.0, float(timeout_s))
        if self._closed:
            return False
        before = self._failures()
        done = _bounded([lambda: self._tracer_provider.force_flush(int(timeout * 1e3)),
                         lambda: self._meter_provider.force_flush(timeout * 1e3)], timeout)
        return done and self._failures() == before

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Final export and release; waits at most ``timeout_s`` (default: the config's timeout)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self._atexit)
        timeout = self.config.timeout_s if timeout_s is None else max(0.0, float(timeout_s))
        _bounded([self._tracer_provider.shutdown, lambda: self._meter_provider.shutdown(timeout * 1e3)], timeout)

    def _failures(self) -> int:
        return self._metric_exporter.failures + self._spans.failures
