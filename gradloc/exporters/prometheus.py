"""Prometheus exposition of the :class:`~gradloc.exporters.state.TelemetryState`.

A custom collector rather than client-library ``Gauge``/``Counter`` objects: the state already holds
the latest step of each rank as numpy columns, so one scrape reads ONE snapshot and turns it into
metric families — no per-record bookkeeping on the ingest path, and series of ranks that went stale
disappear by themselves (they are simply absent from the snapshot).

Every family comes from :data:`~gradloc.exporters.metric_specs.SPECS`. ``collect()`` never raises on
odd data: NaN norms are exported as NaN (a NaN gradient norm must be visible), a missing loss or
loss scale leaves its series out, unknown keys and malformed points are skipped, label values are
made encodable. Exemplars (incident trace ids) are only rendered in the OpenMetrics format — that
is prometheus_client's behaviour, and the one Prometheus asks for when it scrapes. A registry made
with ``sign`` (the agent's signed page links, gradloc/agent/links.py) adds ``sig`` to each exemplar
next to ``trace_id``: what Grafana's exemplar link needs to open the incident's page without the token.
"""
from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Exemplar as PromExemplar
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from gradloc.exporters.metric_specs import AGENT_GAUGES, BY_KEY, SPECS, MetricSpec
from gradloc.exporters.precursor_series import precursor_points
from gradloc.exporters.snapshot import (
    CounterPoint,
    Exemplar,
    HistogramPoint,
    RankPoint,
    TelemetrySnapshot,
    rl_ratio_values,
    shed_values,
)
from gradloc.exporters.state import TelemetryState

log = logging.getLogger(__name__)
_P = TypeVar("_P")
ExemplarSigner = Callable[[str, float], "str | None"]  # (trace id, exemplar time) -> the ``sig`` label value
_EXEMPLAR_CHARS = 128  # OpenMetrics: an exemplar's label names and values together

# Units Prometheus spells as a name suffix. OpenMetrics' ``# UNIT`` line must be a suffix of the
# family name (Prometheus' parser rejects the scrape otherwise), so a unit is declared only where
# the name already ends with it; everything else is dimensionless or a count and stays unit-less.
_PROM_UNITS = ("seconds", "bytes", "ratio")

_LAYER_GAUGES = {"layer_norm": "grad_norm", "layer_max_abs": "grad_max_abs", "update_ratio": "update_ratio"}


def prom_unit(spec: MetricSpec) -> str:
    """The OpenMetrics unit of a family: the name's unit suffix, or "" where it has none."""
    if spec.kind == "counter":
        return ""  # no counter carries a unit suffix before `_total`; keep the rule simple
    return next((u for u in _PROM_UNITS if spec.prom.endswith("_" + u)), "")


def _label(value: object) -> str:
    """A label value that can always be encoded (lone surrogates would make the scrape raise)."""
    s = value if isinstance(value, str) else str(value)
    if s.isascii():
        return s
    return s.encode("utf-8", "replace").decode("utf-8")


def _family(spec: MetricSpec) -> Metric:
    """An empty family for ``spec`` (samples are appended directly: cheaper than ``add_metric``)."""
    unit = prom_unit(spec)
    if spec.kind == "gauge":
        return GaugeMetricFamily(spec.prom, spec.help, labels=spec.labels, unit=unit)
    if spec.kind == "counter":
        return CounterMetricFamily(spec.prom, spec.help, labels=spec.labels, unit=unit)
    return HistogramMetricFamily(spec.prom, spec.help, labels=spec.labels, unit=unit)


def _prom_exemplar(ex: Exemplar | None, sign: ExemplarSigner | None = None) -> PromExemplar | None:
    """OpenMetrics exemplar ``{trace_id="…"}`` (with ``sign``: ``{trace_id="…", sig="…"}``), or None
    where the scrape would not accept it.

    OpenMetrics caps an exemplar's label set at 128 characters (a ``sig`` that would not fit is left
    out), and a non-finite timestamp would make the whole exposition unparsable, so such a timestamp
    is left out instead.
    """
    if ex is None or not ex.trace_id or len(ex.trace_id) > _EXEMPLAR_CHARS - len("trace_id"):
        return None
    ts = ex.time_unix if math.isfinite(ex.time_unix) and ex.time_unix > 0 else None
    labels = {"trace_id": _label(ex.trace_id)}
    sig = _signature(sign, ex) if sign is not None else None
    if sig and len("trace_id") + len(labels["trace_id"]) + len("sig") + len(sig) <= _EXEMPLAR_CHARS:
        labels["sig"] = sig
    return PromExemplar(labels, float(ex.value), ts)


def _signature(sign: ExemplarSigner, ex: Exemplar) -> str | None:
    try:
        sig = sign(ex.trace_id, float(ex.time_unix))
    except (TypeError, ValueError):
        return None
    return sig if isinstance(sig, str) and sig.isascii() else None


def _number(value: object) -> float | None:
    """``value`` as a float; None (no series) for None or anything that is not a number."""
    if value is None:
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _labels(spec: MetricSpec, values: Sequence[object]) -> dict[str, str]:
    """Label dict in the spec's order; a point with too few values gets "" (= label absent)."""
    vals = [_label(v) for v in values[: len(spec.labels)]]
    vals += [""] * (len(spec.labels) - len(vals))
    return dict(zip(spec.labels, vals))


Row = tuple[str, Sample]  # (spec key, sample): one point's samples, added only if all were built


def _rank_rows(p: RankPoint) -> Iterator[Row]:
    labels = {"job": _label(p.summary.job), "rank": _label(p.rank_label)}
    for key, raw in p.gauges():
        value = _number(raw)
        if value is not None:
            yield key, Sample(BY_KEY[key].prom, labels, value)
    if not p.own:
        return
    for feature, value in shed_values(p.summary):
        yield "shed", Sample(BY_KEY["shed"].prom, {**labels, "feature": feature}, value)
    for reference, value in rl_ratio_values(p.summary):
        yield "rl_max_abs_log_ratio", Sample(BY_KEY["rl_max_abs_log_ratio"].prom, {**labels, "reference": reference}, value)


def _layer_index(p: RankPoint) -> list[tuple[int, str]]:
    """(column index, layer label) of the exported layers, first occurrence of a name only."""
    names = p.summary.layers.names
    n = max(0, min(p.layers_exported, len(names)))
    seen: set[str] = set()
    out = []
    for i in range(n):
        name = _label(names[i])
        if name not in seen:
            seen.add(name)
            out.append((i, name))
    return out


def _layer_rows(p: RankPoint) -> Iterator[Row]:
    job, rank = _label(p.summary.job), _label(p.rank_label)
    index = _layer_index(p)
    for key, attr in _LAYER_GAUGES.items():
        name = BY_KEY[key].prom
        values = getattr(p.summary.layers, attr).tolist()  # python floats: one conversion per column
        skip_nan = key == "update_ratio"  # NaN there means "no ratio known", not a bad value
        for i, layer in index:
            v = values[i]
            if not (skip_nan and math.isnan(v)):
                yield key, Sample(name, {"job": job, "rank": rank, "layer": layer}, v)


def _point_rows(p: RankPoint) -> Iterator[Row]:
    yield from _rank_rows(p)
    yield from _layer_rows(p)
    labels = {"job": _label(p.summary.job), "rank": _label(p.rank_label)}
    for key, extra, value in precursor_points(p):
        yield key, Sample(BY_KEY[key].prom, {**labels, **{k: _label(v) for k, v in extra.items()}}, value)


def _counter_rows(c: CounterPoint, sign: ExemplarSigner | None = None) -> Iterator[Row]:
    spec = BY_KEY.get(c.key)
    value = _number(c.value)
    if spec is not None and spec.kind == "counter" and value is not None:
        yield c.key, Sample(spec.prom + "_total", _labels(spec, c.labels), value, None,
                            _prom_exemplar(c.exemplar, sign))


def _buckets(spec: MetricSpec, h: HistogramPoint,
             sign: ExemplarSigner | None = None) -> list[tuple[str, float, PromExemplar | None]]:
    """Cumulative ``le`` buckets; the state keeps per-bucket counts (len(buckets) + 1)."""
    bounds = [floatToGoString(b) for b in spec.buckets] + ["+Inf"]
    counts = list(h.counts[: len(bounds)]) + [0] * (len(bounds) - len(h.counts))
    exemplars = list(h.exemplars[: len(bounds)]) + [None] * (len(bounds) - len(h.exemplars))
    return [(le, float(c), _prom_exemplar(e, sign))
            for le, c, e in zip(bounds, itertools.accumulate(counts), exemplars)]


def _histogram_rows(h: HistogramPoint, sign: ExemplarSigner | None = None) -> Iterator[Row]:
    spec = BY_KEY.get(h.key)
    if spec is None or spec.kind != "histogram":
        return
    labels = _labels(spec, h.labels)
    buckets = _buckets(spec, h, sign)
    for le, count, ex in buckets:
        yield h.key, Sample(spec.prom + "_bucket", {**labels, "le": le}, count, None, ex)
    # _count is the +Inf bucket (they must agree); _sum only when it is a number. A histogram with
    # negative buckets (the RL log ratios and advantages) has neither: OpenMetrics forbids _sum there
    # and allows _count only with _sum; its count is the le="+Inf" bucket.
    if spec.buckets[0] < 0:
        return
    yield h.key, Sample(spec.prom + "_count", labels, buckets[-1][1])
    total = _number(h.sum)
    if total is not None and math.isfinite(total):
        yield h.key, Sample(spec.prom + "_sum", labels, total)


def _add_all(fams: dict[str, Metric], rows_of: Callable[[_P], Iterator[Row]], points: Iterable[_P]) -> None:
    """Add every point's samples; a malformed point is logged and skipped whole (no half series)
    rather than failing the scrape."""
    for point in points:
        try:
            rows = list(rows_of(point))
        except Exception:
            log.warning("Prometheus scrape: skipped a malformed %s", type(point).__name__, exc_info=True)
            continue
        for key, sample in rows:
            fams[key].samples.append(sample)


def families(snap: TelemetrySnapshot, sign: ExemplarSigner | None = None) -> list[Metric]:
    """One metric family per spec (in SPECS order), filled from one snapshot; ``sign``: exemplars get ``sig``."""
    fams = {spec.key: _family(spec) for spec in SPECS}
    _add_all(fams, _point_rows, snap.ranks)
    _add_all(fams, functools.partial(_counter_rows, sign=sign), snap.counters)
    _add_all(fams, functools.partial(_histogram_rows, sign=sign), snap.histograms)
    for key in AGENT_GAUGES:
        fams[key].samples.append(Sample(BY_KEY[key].prom, {}, float(getattr(snap, key))))
    return [fams[spec.key] for spec in SPECS]


class GradlocCollector(Collector):
    """prometheus_client custom collector: one ``state.snapshot()`` per scrape. A scrape reads and empties the
    "prometheus" windows: ``gradloc_grad_global_norm_max`` is the largest norm since the previous scrape (of
    any Prometheus: two servers scraping one daemon split the steps between them, docs/metrics.md)."""

    def __init__(self, state: TelemetryState, sign: ExemplarSigner | None = None) -> None:
        self._state, self._sign = state, sign

    def collect(self) -> Iterable[Metric]:
        return families(self._state.snapshot(reader="prometheus"), self._sign)

    def describe(self) -> Iterable[Metric]:
        """Empty families: lets a registry detect name clashes without taking a snapshot."""
        return [_family(spec) for spec in SPECS]


def make_registry(state: TelemetryState, sign: ExemplarSigner | None = None) -> CollectorRegistry:
    """A fresh registry holding only gradloc's collector (never the process-global REGISTRY); with
    ``sign``, its exemplars carry a signed page link's ``sig`` (only for a scrape that sent the token)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GradlocCollector(state, sign))
    return registry


def render(state_or_registry: TelemetryState | Collector, accept_header: str | None) -> tuple[bytes, str]:
    """Body and Content-Type of one scrape, negotiated from the ``Accept`` header.

    ``application/openmetrics-text`` gets OpenMetrics (with exemplars); anything else the classic
    text format.
    """
    if isinstance(state_or_registry, TelemetryState):
        registry: Collector = make_registry(state_or_registry)
    else:
        registry = state_or_registry
    encoder, content_type = choose_encoder(accept_header or "")
    return encoder(registry), content_type
