"""One OTLP trace per correlated incident, and a span processor that never drops silently.

Trace shape (trace id = the incident's ``trace_id``, see :mod:`gradloc.exporters.ids`)::

    gradloc.incident                      root: [incident time, closed time]; job, step, status, ...
      ├─ gradloc.detect      (per rank)   the rank's SpikeEvent fields (gradloc.spike.*)
      └─ gradloc.localize    (per rank)   method, status, probes, explained share, ... (gradloc.localization.*)
           ├─ event culprit_span          text, context, token ids, sample, start/end, shares (gradloc.span.*)
           └─ gradloc.micro_batch         one per micro-batch of the rank with a share > 0
    root events: rank_missing (one per rank that never reported)

Span attributes may hold step numbers, sample ids, token ids and text: that is what traces are for
(only *metric* labels are bounded). Records carry no stage durations, so the stage spans are points
at the time the rank reported (clamped into the root's interval). RL fields of a culprit span are
emitted as ``gradloc.rl.<field>`` when the record has them (none does yet).

Why our own processor: the SDK's ``BatchSpanProcessor`` drops the oldest span when its queue is full
and says nothing. :class:`CountingBatchSpanProcessor` bounds its queue, rejects spans beyond it and
counts every lost span (queue full, after shutdown, failed export) into
``export_dropped{exporter="otlp_traces"}`` and every failed batch into ``export_failures``.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from gradloc.exporters.ids import forced_trace_id, new_trace_id, parse_trace_id
from gradloc.exporters.state import TelemetryState
from gradloc.records import CulpritSpan, Incident
from gradloc.reports import CorrelatedIncident, RankSpan

log = logging.getLogger(__name__)

EXPORTER = "otlp_traces"
RL_FIELDS = ("advantage", "reward", "return_", "value", "logprob", "ref_logprob", "kl", "importance_ratio",
             "episode_id", "policy_version")
"""CulpritSpan fields (when records grow them) emitted as ``gradloc.rl.<name>`` instead of ``gradloc.span.*``."""

_Scalar = (str, bool, int, float)


def _attr(value: Any) -> Any:
    """``value`` as an OTel attribute value, or None when it cannot be one (None, nested records)."""
    if isinstance(value, _Scalar):
        return value
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, _Scalar) for v in value):
        kinds = {type(v) for v in value}
        if len(kinds) == 1:
            return list(value)
        if kinds <= {int, float}:  # a homogeneous list is required: ints among floats become floats
            return [float(v) for v in value]
        return [str(v) for v in value]
    if isinstance(value, (tuple, list)) and not value:
        return []
    return None


def flat_attributes(prefix: str, record: Any, skip: Iterable[str] = (),
                    rename: dict[str, str] | None = None) -> dict[str, Any]:
    """The scalar (and scalar-list) fields of a dataclass record as ``prefix + name`` attributes."""
    out: dict[str, Any] = {}
    skipped = set(skip)
    for f in dataclasses.fields(record):
        value = _attr(getattr(record, f.name))
        if f.name in skipped or value is None:
            continue
        out[(rename or {}).get(f.name, prefix + f.name)] = value
    return out


def _ns(t_unix: float) -> int:
    return round((t_unix if math.isfinite(t_unix) else time.time()) * 1e9)


def root_attributes(inc: CorrelatedIncident) -> dict[str, Any]:
    attrs = flat_attributes("gradloc.", inc, skip=("rank_shares", "micro_batch_shares", "spans", "findings",
                                                   "trace_id", "time_unix", "closed_unix"))
    for name in ("expected", "reported", "missing"):
        attrs.pop(f"gradloc.ranks_{name}", None)
        attrs[f"gradloc.ranks.{name}"] = list(getattr(inc, f"ranks_{name}"))
    if not inc.note:
        attrs.pop("gradloc.note", None)
    return attrs


def detect_attributes(f: Incident, rank_share: float | None) -> dict[str, Any]:
    attrs = {"gradloc.rank": f.rank, "gradloc.step": f.step, "gradloc.finding_id": f.incident_id}  # the root has the incident_id
    attrs.update(flat_attributes("gradloc.spike.", f.spike))
    if rank_share is not None:
        attrs["gradloc.rank.share"] = rank_share
    return attrs


def localize_attributes(f: Incident) -> dict[str, Any]:
    attrs: dict[str, Any] = {"gradloc.rank": f.rank}
    attrs.update(flat_attributes("gradloc.localization.", f.localization, skip=("culprits", "spans", "step")))
    attrs["gradloc.localization.culprits"] = len(f.localization.culprits)
    return attrs


def culprit_span_attributes(rs: RankSpan) -> dict[str, Any]:
    span: CulpritSpan = rs.span
    attrs: dict[str, Any] = {"gradloc.rank": rs.rank}
    attrs.update(flat_attributes("gradloc.span.", span, rename={n: f"gradloc.rl.{n.rstrip('_')}" for n in RL_FIELDS}))
    attrs["gradloc.span.global_share"] = rs.share
    return attrs


def emit_incident(tracer: trace.Tracer, inc: CorrelatedIncident,
                  in_root: Callable[[], None] = lambda: None) -> trace.Span:
    """Emit the incident's trace; ``in_root`` runs with the root span current (metric exemplars)."""
    start = _ns(inc.time_unix)
    end = max(start, _ns(inc.closed_unix or inc.time_unix))
    trace_id = inc.trace_id
    try:
        parse_trace_id(trace_id)
    except ValueError:
        log.warning("incident %s has an invalid trace id %r; using a fresh one", inc.incident_id, trace_id)
        trace_id = new_trace_id()
    with forced_trace_id(trace_id):  # an empty Context: never a child of whatever span the caller has open
        root = tracer.start_span("gradloc.incident", context=Context(), start_time=start,
                                 attributes=root_attributes(inc))
    for rank in inc.ranks_missing:
        root.add_event("rank_missing", {"gradloc.rank": rank}, timestamp=end)
    localize = _stage_spans(tracer, root, inc, start, end)
    _micro_batch_spans(tracer, root, inc, localize, start)
    for rs in inc.spans:
        parent, t = localize.get(rs.rank, (root, start))
        parent.add_event("culprit_span", culprit_span_attributes(rs), timestamp=t)
    for span, t in localize.values():
        span.end(end_time=t)
    with trace.use_span(root, end_on_exit=False):
        in_root()
    root.end(end_time=end)
    return root


def _stage_spans(tracer: trace.Tracer, root: trace.Span, inc: CorrelatedIncident, start: int,
                 end: int) -> dict[int, tuple[trace.Span, int]]:
    """Point spans ``gradloc.detect`` per finding; open ``gradloc.localize`` spans, by rank."""
    ctx = trace.set_span_in_context(root, Context())
    shares = {r.rank: r.share for r in inc.rank_shares}
    localize: dict[int, tuple[trace.Span, int]] = {}
    for f in inc.findings:
        t = min(max(_ns(f.time_unix), start), end)
        tracer.start_span("gradloc.detect", context=ctx, start_time=t,
                          attributes=detect_attributes(f, shares.get(f.rank))).end(end_time=t)
        if f.localization is not None and f.rank not in localize:
            span = tracer.start_span("gradloc.localize", context=ctx, start_time=t,
                                     attributes=localize_attributes(f))
            localize[f.rank] = (span, t)
    return localize


def _micro_batch_spans(tracer: trace.Tracer, root: trace.Span, inc: CorrelatedIncident,
                       localize: dict[int, tuple[trace.Span, int]], start: int) -> None:
    for mb in inc.micro_batch_shares:
        if not mb.share > 0:
            continue
        parent, t = localize.get(mb.rank, (root, start))
        attrs = {"gradloc.rank": mb.rank, "gradloc.micro_batch": mb.micro_batch, "gradloc.share": mb.share}
        tracer.start_span("gradloc.micro_batch", context=trace.set_span_in_context(parent, Context()),
                          start_time=t, attributes=attrs).end(end_time=t)


class CountingBatchSpanProcessor(SpanProcessor):
    """Batches ended spans to ``exporter`` on a worker thread; a full queue rejects and counts.

    ``on_end`` is a lock and an append (never the network). A batch is exported when it reaches
    ``max_batch`` spans, every ``delay_s``, on ``force_flush`` and on ``shutdown``.
    """

    def __init__(self, exporter: SpanExporter, state: TelemetryState, *, max_queue: int = 2048,
                 max_batch: int = 512, delay_s: float = 5.0, shutdown_timeout_s: float = 5.0) -> None:
        self._exporter, self._state = exporter, state
        self._max_queue, self._max_batch, self._delay_s = max_queue, max_batch, delay_s
        self._shutdown_timeout_s = shutdown_timeout_s
        self._queue: deque[ReadableSpan] = deque()
        self._flush_events: list[threading.Event] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.failures = 0  # failed batches (also in the state, for force_flush to compare)
        self.dropped = 0  # spans lost
        self._thread = threading.Thread(target=self._run, name="gradloc-otlp-spans", daemon=True)
        self._thread.start()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        with self._cond:
            if self._stopping or len(self._queue) >= self._max_queue:
                self._drop(1)
                return
            self._queue.append(span)
            if len(self._queue) >= self._max_batch:
                self._cond.notify()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        event = threading.Event()
        with self._cond:
            if not self._thread.is_alive():
                return not self._queue
            self._flush_events.append(event)
            self._cond.notify()
        return event.wait(timeout_millis / 1e3)

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(self._shutdown_timeout_s)
        try:
            self._exporter.shutdown()
        except Exception:
            log.warning("OTLP span exporter shutdown failed", exc_info=True)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not (len(self._queue) >= self._max_batch or self._flush_events or self._stopping):
                    self._cond.wait(self._delay_s)
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self._max_batch))]
                events: list[threading.Event] = []
                if not self._queue:  # everything queued before these flush requests is in `batch` now
                    events, self._flush_events = self._flush_events, []
                stop = self._stopping and not self._queue
            if batch:
                self._export(batch)
            for event in events:
                event.set()
            if stop:
                return

    def _export(self, batch: list[ReadableSpan]) -> None:
        try:
            ok = self._exporter.export(batch) is SpanExportResult.SUCCESS
        except Exception:
            log.warning("OTLP span export raised", exc_info=True)
            ok = False
        if not ok:
            self._state.count("export_failures", (EXPORTER,))
            with self._cond:
                self.failures += 1
                self._drop(len(batch))

    def _drop(self, n: int) -> None:
        """Count ``n`` lost spans (caller holds ``self._cond``)."""
        self.dropped += n
        self._state.count("export_dropped", (EXPORTER,), n=n)
