"""OTLP exporter against a real OTLP/gRPC receiver: metrics per spec, exemplars, incident traces,
ids immune to ``random.seed``, and a collector that is down, refusing or slow."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry import metrics as metrics_api
from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from gradloc.errors import ConfigError
from gradloc.exporters.ids import (
    GradlocIdGenerator,
    forced_trace_id,
    new_span_id,
    new_trace_id,
)
from gradloc.exporters.metric_specs import SPECS
from gradloc.exporters.otlp import OtlpConfig, OtlpExporter
from gradloc.exporters.otlp_traces import culprit_span_attributes
from gradloc.exporters.state import TelemetryState
from gradloc.records import CulpritSpan, GroupTokens
from gradloc.reports import CorrelatedIncident, RankSpan
from tests.builders import (
    NAN,
    columns,
    make_incident,
    nonfinite_incident,
    precursor_findings,
    precursor_stats,
    rl_stats,
    sample_stats,
    summary,
)
from tests.exporters.otlp_receiver import OtlpReceiver, attrs, closed_port

pytestmark = pytest.mark.wallclock  # the OTLP flush is timed (tests/conftest.py: never beside a multi-process test)

JOB = "llm-7b"
LAYERS = ("blocks.0", "blocks.1", "head")
SPANS_PER_INCIDENT = 9  # make_incident: root + 2 detect + 2 localize + 4 micro-batch


@contextlib.contextmanager
def running(state: TelemetryState, endpoint: str, **kw) -> Iterator[OtlpExporter]:
    """An exporter that only exports on force_flush (60 s period) and is always shut down."""
    kw.setdefault("export_interval_s", 60.0)
    kw.setdefault("timeout_s", 2.0)
    ex = OtlpExporter(state, endpoint, **kw)
    try:
        yield ex
    finally:
        ex.shutdown(1.0)


def fresh_incident(base: CorrelatedIncident | None = None) -> CorrelatedIncident:
    base = base or make_incident(time_unix=time.time() - 5.0)
    return dataclasses.replace(base, trace_id=new_trace_id())


def counter(state: TelemetryState, key: str, labels: tuple[str, ...]) -> float:
    return sum(c.value for c in state.snapshot().counters if c.key == key and c.labels == labels)


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def populate(state: TelemetryState, ex: OtlpExporter) -> CorrelatedIncident:
    """Give every spec a value: 2 ranks × 3 layers (a NaN norm, a NaN = unknown ratio), an incident,
    the self-metrics."""
    now = time.time()
    for rank in (0, 1):
        norms = [0.5, NAN if rank == 1 else 0.3, 0.02 * (rank + 1)]
        s = summary(JOB, rank, 100, columns(norms, LAYERS, update_ratio=[NAN, 1e-3, 2e-3]), time_unix=now - 0.1,
                 grad_scale=65536.0, skipped=rank == 1, shed=("update_ratio",) if rank == 1 else (), rl=rl_stats(),
                 samples=sample_stats(JOB, rank, 100, now - 0.1), precursors=precursor_stats(),
                 precursor_findings=precursor_findings(JOB, rank, 100, now - 0.1))
        state.observe_step(s)
        ex.on_step(s)
    inc = fresh_incident()
    state.observe_incident(inc)
    with TracerProvider().get_tracer("caller").start_as_current_span("caller's own span"):
        ex.on_incident(inc)  # the incident must still be a root span with its own trace id
    for key, labels in (("records", ("step",)), ("rejected", ("malformed",)), ("duplicates", ("incident",)),
                        ("limited", ("culprits",)), ("retention_deleted", ("inbox",)),
                        ("export_failures", ("store",)),
                        ("export_dropped", ("store",)), ("series_dropped", ("max_layers",))):
        state.count(key, labels)
    state.set_cumulative("client_dropped", (JOB, "0", "queue_full"), 3)
    state.observe_events(JOB, 0, (("probe_errors", 2), ("some_new_counter", 1)))
    state.observe_groups(JOB, (GroupTokens(kind="source", name="web", samples=4, tokens=512),))
    state.set_pending(2, queued=3)
    return inc


@pytest.fixture(scope="module")
def exported() -> Iterator[SimpleNamespace]:
    state = TelemetryState()
    with OtlpReceiver() as rx:
        with running(state, rx.endpoint, resource_attributes={"deployment.environment": "test"}) as ex:
            inc = populate(state, ex)
            t0 = time.perf_counter()
            flushed = ex.force_flush(5.0)
            flush_s = time.perf_counter() - t0
            providers = (ex._tracer_provider, ex._meter_provider)
        yield SimpleNamespace(state=state, rx=rx, inc=inc, flushed=flushed, flush_s=flush_s, providers=providers,
                              metrics={name: ms[0] for name, ms in rx.metrics().items()}, spans=rx.spans())


# -- ids -------------------------------------------------------------------------------------------
def _ids_after_seed() -> tuple:
    random.seed(42)
    gen = GradlocIdGenerator()
    return new_trace_id(), new_span_id(), gen.generate_trace_id(), gen.generate_span_id()


def test_ids_do_not_follow_random_seed():
    random.seed(42)
    sdk_default = RandomIdGenerator().generate_trace_id()
    random.seed(42)
    assert RandomIdGenerator().generate_trace_id() == sdk_default  # the hazard this module exists for
    first, second = _ids_after_seed(), _ids_after_seed()
    assert all(a != b for a, b in zip(first, second))
    trace_hex, span_hex = first[:2]
    assert len(trace_hex) == 32 and int(trace_hex, 16) and len(span_hex) == 16 and int(span_hex, 16)


def test_forced_trace_id_gives_one_root_span_that_id():
    tracer = TracerProvider(id_generator=GradlocIdGenerator()).get_tracer("t")
    wanted = new_trace_id()
    other_thread: list[int] = []
    with forced_trace_id(wanted):
        t = threading.Thread(target=lambda: other_thread.append(tracer.start_span("x").get_span_context().trace_id))
        t.start()
        t.join()
        root = tracer.start_span("root", context=Context())
        second = tracer.start_span("second root", context=Context())
    assert root.get_span_context().trace_id == int(wanted, 16) and root.parent is None
    assert second.get_span_context().trace_id != int(wanted, 16)  # consumed by the first root
    assert other_thread[0] != int(wanted, 16)  # thread-local
    assert tracer.start_span("after").get_span_context().trace_id != int(wanted, 16)


@pytest.mark.parametrize("bad", ["", "abc", "0" * 32, "g" * 32, "0af7651916cd43dd8448eb211c80319c0"])
def test_forced_trace_id_rejects_non_ids(bad):
    with pytest.raises(ValueError), forced_trace_id(bad):
        pass


# -- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    {"endpoint": ""}, {"endpoint": "localhost"}, {"endpoint": "ftp://collector:4317"},
    {"endpoint": "localhost:99999"}, {"endpoint": "https://collector:4317"},  # TLS asked with insecure=True
    {"export_interval_s": 0}, {"timeout_s": math.nan}, {"timeout_s": -1}, {"service_name": ""},
    {"headers": {"Authorization": "Bearer x"}}, {"headers": {"x-token": 5}},
    {"resource_attributes": {"team": ["a"]}}, {"max_queue_spans": 0},
])
def test_bad_config_raises_config_error(kw):
    args = {"endpoint": "localhost:4317", **kw}
    with pytest.raises(ConfigError):
        OtlpExporter(TelemetryState(), **args)


def test_good_endpoint_forms_validate():
    for endpoint, insecure in (("localhost:4317", True), ("http://10.0.0.1:4317", True),
                               ("https://otel.example.com:443", False)):
        assert OtlpConfig(endpoint, insecure=insecure, headers={"x-api-key": "k"}).headers == (("x-api-key", "k"),)


def test_missing_otlp_extra_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.metric_exporter", None)
    with pytest.raises(ConfigError, match=r"pip install gradloc\[otlp\]"):
        OtlpExporter(TelemetryState(), "localhost:4317")


# -- metrics ---------------------------------------------------------------------------------------
def test_every_spec_arrives_with_its_name_unit_and_kind(exported):
    assert exported.flushed and exported.flush_s < 5.0
    kinds = {"gauge": "gauge", "counter": "sum", "histogram": "histogram"}
    missing = [s.otel for s in SPECS if s.otel not in exported.metrics]
    assert not missing
    for spec in SPECS:
        m = exported.metrics[spec.otel]
        assert (m.unit, m.description, m.WhichOneof("data")) == (spec.unit, spec.help, kinds[spec.kind]), spec.otel
        if spec.kind == "counter":
            assert m.sum.is_monotonic


def test_resource_is_our_own_and_global_providers_untouched(exported):
    for signal in ("metrics", "traces"):
        for res in exported.rx.resources(signal):
            assert res["service.name"] == "gradloc-agent" and res["deployment.environment"] == "test"
    assert trace_api.get_tracer_provider() not in exported.providers
    assert metrics_api.get_meter_provider() not in exported.providers


def _points(metric) -> dict[tuple, object]:
    data = getattr(metric, metric.WhichOneof("data"))
    return {tuple(sorted(attrs(p.attributes).items())): p for p in data.data_points}


def _by_rank_layer(metric) -> dict[str, float]:
    return {dict(k)["rank"] + "/" + dict(k)["layer"]: p.as_double for k, p in _points(metric).items()}


def test_per_layer_gauges_match_the_state(exported):
    """Finite values equal the state's; non-finite ones are left out (SDK 1.45 drops them anyway)."""
    snap = exported.state.snapshot()
    for name, column in (("gradloc.grad.norm", "grad_norm"), ("gradloc.grad.max_abs", "grad_max_abs"),
                         ("gradloc.update.ratio", "update_ratio")):
        want = {f"{p.summary.rank}/{layer}": v for p in snap.ranks
                for layer, v in zip(p.summary.layers.names, getattr(p.summary.layers, column).tolist())
                if math.isfinite(v)}
        assert _by_rank_layer(exported.metrics[name]) == want, name
    norms = _by_rank_layer(exported.metrics["gradloc.grad.norm"])
    assert len(norms) == 5 and "1/blocks.1" not in norms  # rank 1's NaN layer
    assert len(_by_rank_layer(exported.metrics["gradloc.update.ratio"])) == 4  # NaN = unknown ratio
    nonfinite = {dict(k)["rank"]: p.as_int for k, p in _points(exported.metrics["gradloc.grad.nonfinite"]).items()}
    assert nonfinite == {"0": 0, "1": 1}  # ... but the NaN is visible here
    labels = set(dict(next(iter(_points(exported.metrics["gradloc.grad.norm"])))))
    assert labels == {"job", "rank", "layer"}


def test_precursor_findings_count_by_closed_attributes_only(exported):
    points = {(d["rank"], d["statistic"], d["trend"], d["pages"]): p.as_double
              for d, p in ((dict(k), p) for k, p in _points(exported.metrics["gradloc.precursor.findings"]).items())}
    assert points == {(r, s, t, pages): 1.0 for r in ("0", "1") for s, t, pages in (
        ("attn_entropy", "falling", "false"), ("attn_entropy", "falling", "true"), ("expert_load_max", "rising", "false"))}
    labels = set(dict(next(iter(_points(exported.metrics["gradloc.precursor.findings"])))))
    assert labels == {"job", "rank", "statistic", "trend", "pages"}  # never the layer, step or sample


def test_counters_come_from_the_state_and_incidents_are_not_double_counted(exported):
    steps = _points(exported.metrics["gradloc.step.count"])
    assert {dict(k)["rank"]: p.as_double for k, p in steps.items()} == {"0": 1.0, "1": 1.0}
    assert [p.as_double for p in _points(exported.metrics["gradloc.step.skipped"]).values()] == [1.0]
    incidents = _points(exported.metrics["gradloc.incident.count"])
    assert len(incidents) == 1
    ((key, point),) = incidents.items()
    assert dict(key) == {"job": JOB, "status": "partial"} and point.as_int == 1
    spikes = {(dict(k)["rank"], dict(k)["kind"]): p.as_int for k, p in _points(exported.metrics["gradloc.spike.count"]).items()}
    assert spikes == {(r, k): 1 for r in ("0", "1") for k in ("grad_spike", "loss_spike")}
    pending = _points(exported.metrics["gradloc.agent.pending"])
    assert [p.as_int or p.as_double for p in pending.values()] == [2]
    queued = _points(exported.metrics["gradloc.agent.queue_depth"])
    assert [p.as_int or p.as_double for p in queued.values()] == [3]


def test_monitor_events_arrive_by_declared_name_and_other(exported):
    m = exported.metrics["gradloc.monitor.events"]
    assert m.unit == "{event}" and m.sum.is_monotonic
    events = {(dict(k)["job"], dict(k)["rank"], dict(k)["event"]): p.as_int or p.as_double
              for k, p in _points(m).items()}
    assert events == {(JOB, "0", "probe_errors"): 2, (JOB, "0", "other"): 1}  # "some_new_counter" is not a label


def test_histograms_use_the_specs_explicit_buckets(exported):
    for spec in (s for s in SPECS if s.kind == "histogram"):
        m = exported.metrics[spec.otel]
        for p in m.histogram.data_points:
            assert list(p.explicit_bounds) == [float(b) for b in spec.buckets], spec.otel
            assert len(p.bucket_counts) == len(spec.buckets) + 1
    norms = _points(exported.metrics["gradloc.step.grad_norm"])
    assert {dict(k)["rank"]: p.count for k, p in norms.items()} == {"0": 1, "1": 1}
    assert [p.sum for p in _points(exported.metrics["gradloc.localization.probes"]).values()] == [2.0]


def test_incident_and_spike_counters_carry_the_incident_trace_as_exemplar(exported):
    trace_id = bytes.fromhex(exported.inc.trace_id)
    root = next(s for s in exported.spans if s.name == "gradloc.incident")
    for name in ("gradloc.incident.count", "gradloc.spike.count", "gradloc.localization.probes"):
        for p in _points(exported.metrics[name]).values():
            assert [(e.trace_id, e.span_id) for e in p.exemplars] == [(trace_id, root.span_id)], name
    for p in _points(exported.metrics["gradloc.step.count"]).values():
        assert not p.exemplars  # observations carry no trace context


# -- traces ----------------------------------------------------------------------------------------
def test_incident_trace_has_root_stage_and_micro_batch_spans(exported):
    inc, spans = exported.inc, exported.spans
    assert len(spans) == SPANS_PER_INCIDENT
    assert {s.trace_id for s in spans} == {bytes.fromhex(inc.trace_id)}
    (root,) = [s for s in spans if s.name == "gradloc.incident"]
    a = attrs(root.attributes)
    assert root.parent_span_id == b""  # a root, even though on_incident ran under the caller's span
    assert (a["gradloc.job"], a["gradloc.step"], a["gradloc.status"], a["gradloc.incident_id"]) == \
        (JOB, inc.step, "partial", inc.incident_id)
    assert (a["gradloc.ranks.expected"], a["gradloc.ranks.missing"], a["gradloc.probes"]) == ([0, 1, 2], [2], 2)
    assert a["gradloc.explained_share"] == 0.93 and a["gradloc.kinds"] == ["grad_spike", "loss_spike"]
    assert (root.start_time_unix_nano, root.end_time_unix_nano) == (round(inc.time_unix * 1e9),
                                                                    round(inc.closed_unix * 1e9))
    assert [(e.name, attrs(e.attributes)) for e in root.events] == [("rank_missing", {"gradloc.rank": 2})]
    by_name = {n: [s for s in spans if s.name == n] for n in ("gradloc.detect", "gradloc.localize", "gradloc.micro_batch")}
    assert all(s.parent_span_id == root.span_id for s in by_name["gradloc.detect"] + by_name["gradloc.localize"])
    detect = {attrs(s.attributes)["gradloc.rank"]: attrs(s.attributes) for s in by_name["gradloc.detect"]}
    assert sorted(detect) == [0, 1] and detect[0]["gradloc.spike.z"] == 41.2
    # one id: the root carries the incident's, each rank's detect span its finding's (an alias)
    assert [detect[r]["gradloc.finding_id"] for r in (0, 1)] == [f.incident_id for f in inc.findings]
    assert all("gradloc.incident_id" not in a for a in detect.values())
    localize = {attrs(s.attributes)["gradloc.rank"]: s for s in by_name["gradloc.localize"]}
    assert attrs(localize[1].attributes)["gradloc.localization.status"] == "unverified"
    assert attrs(localize[0].attributes)["gradloc.localization.norm_without_culprits"] == 0.9
    mbs = {(attrs(s.attributes)["gradloc.rank"], attrs(s.attributes)["gradloc.micro_batch"]):
           (s.parent_span_id, attrs(s.attributes)["gradloc.share"]) for s in by_name["gradloc.micro_batch"]}
    assert mbs == {(mb.rank, mb.micro_batch): (localize[mb.rank].span_id, mb.share) for mb in inc.micro_batch_shares}


def test_culprit_spans_are_events_on_the_localize_span(exported):
    events = {attrs(s.attributes)["gradloc.rank"]: [attrs(e.attributes) for e in s.events if e.name == "culprit_span"]
              for s in exported.spans if s.name == "gradloc.localize"}
    (bell,), (zebra,) = events[0], events[1]
    assert (bell["gradloc.span.text"], bell["gradloc.span.token_ids"]) == (" bell", [66])
    assert bell["gradloc.span.context_after"] == " rings. The old clock" and bell["gradloc.span.sample_id"] == "s1200-3-1"
    assert (bell["gradloc.span.start"], bell["gradloc.span.end"], bell["gradloc.span.micro_batch"]) == (41, 42, 3)
    assert bell["gradloc.span.share"] == 0.9 and bell["gradloc.span.global_share"] == pytest.approx(0.648)
    assert (zebra["gradloc.span.text"], zebra["gradloc.span.token_ids"]) == ("zebra\tqu", [901, 77])
    assert "gradloc.span.sample_id" not in zebra  # None is left out, not sent as a string
    assert not any(k.startswith("gradloc.rl.") for k in bell)  # records carry no RL fields yet


def test_rl_fields_of_culprit_spans_get_their_own_namespace():
    @dataclasses.dataclass(frozen=True)
    class RlSpan(CulpritSpan):  # what an RL record could carry one day
        advantage: float | None = None
        episode_id: str | None = None

    span = RlSpan(micro_batch=0, sample=1, start=2, end=3, share=0.5, token_ids=(7,), text="x", advantage=-1.5)
    a = culprit_span_attributes(RankSpan(rank=3, share=0.25, span=span))
    assert (a["gradloc.rl.advantage"], a["gradloc.span.global_share"], a["gradloc.rank"]) == (-1.5, 0.25, 3)
    assert "gradloc.rl.episode_id" not in a and "gradloc.span.advantage" not in a


def test_seeded_runs_still_get_different_ids():
    roots = []
    with OtlpReceiver() as rx:
        for _ in range(2):
            random.seed(42)
            with running(TelemetryState(), rx.endpoint) as ex:
                ex.on_incident(fresh_incident())
                assert ex.force_flush(5.0)
        roots = [s for s in rx.spans() if s.name == "gradloc.incident"]
    assert len(roots) == 2
    assert roots[0].trace_id != roots[1].trace_id and roots[0].span_id != roots[1].span_id


def test_invalid_incident_trace_id_still_exports_a_trace():
    state = TelemetryState()
    inc = nonfinite_incident(time_unix=time.time())  # trace id all zeros, inf/NaN values
    with OtlpReceiver() as rx, running(state, rx.endpoint) as ex:
        ex.on_incident(inc)
        assert ex.force_flush(5.0)
        (root,) = [s for s in rx.spans() if s.name == "gradloc.incident"]
    assert root.trace_id != bytes(16) and math.isnan(attrs(root.attributes)["gradloc.global_norm"])


def test_periodic_export_without_flush():
    state = TelemetryState()
    with OtlpReceiver() as rx, running(state, rx.endpoint, export_interval_s=0.2) as ex:
        s = summary(JOB, 0, 1, columns([0.1, 0.2]), time_unix=time.time())
        state.observe_step(s)
        ex.on_step(s)
        ex.on_incident(fresh_incident())
        assert rx.wait_for(lambda r: "gradloc.grad.norm" in r.metrics() and len(r.spans()) == SPANS_PER_INCIDENT, 5.0)


# -- failures --------------------------------------------------------------------------------------
def test_collector_down_never_blocks_and_failures_are_counted():
    state = TelemetryState()
    ex = OtlpExporter(state, f"127.0.0.1:{closed_port()}", export_interval_s=60.0, timeout_s=0.5)
    try:
        s = summary(JOB, 0, 1, columns([0.1, 0.2]), time_unix=time.time())
        state.observe_step(s)
        for call, arg in ((ex.on_step, s), (ex.on_incident, fresh_incident())):
            t0 = time.perf_counter()
            call(arg)
            assert time.perf_counter() - t0 < 0.25  # a call that waited on the network would take the 0.5 s timeout
        t0 = time.perf_counter()
        flushed = ex.force_flush(0.3)
        assert time.perf_counter() - t0 < 0.3 + 0.15
        assert flushed is False  # either still retrying at the deadline, or failed
        assert wait_until(lambda: counter(state, "export_failures", ("otlp_metrics",)) > 0
                          and counter(state, "export_failures", ("otlp_traces",)) > 0, 5.0)
        assert counter(state, "export_dropped", ("otlp_traces",)) == SPANS_PER_INCIDENT
        assert ex.force_flush(1.0) is False  # the SDK's own flush says True here; ours reports the failure
    finally:
        t0 = time.perf_counter()
        ex.shutdown(0.5)
        assert time.perf_counter() - t0 < 0.5 + 0.15


@pytest.mark.parametrize("code", [grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT])
def test_receiver_error_status_is_counted(code):
    state = TelemetryState()
    with OtlpReceiver(fail_with=code) as rx, running(state, rx.endpoint, timeout_s=1.0) as ex:
        state.observe_step(s := summary(JOB, 0, 1, columns([0.1]), time_unix=time.time()))
        ex.on_step(s)
        ex.on_incident(fresh_incident())
        assert ex.force_flush(3.0) is False
        assert rx.calls >= 2 and not rx.spans() and not rx.metrics()
    assert counter(state, "export_failures", ("otlp_metrics",)) >= 1
    assert counter(state, "export_failures", ("otlp_traces",)) == 1
    assert counter(state, "export_dropped", ("otlp_traces",)) == SPANS_PER_INCIDENT


def test_full_span_queue_drops_are_counted_not_silent():
    state, n = TelemetryState(), 5
    with OtlpReceiver(delay_s=0.4) as rx, running(state, rx.endpoint, max_queue_spans=4, timeout_s=3.0) as ex:
        t0 = time.perf_counter()
        for _ in range(n):
            ex.on_incident(fresh_incident())
        assert time.perf_counter() - t0 < 0.05 * n  # a backed-up collector does not slow recording
        assert ex.force_flush(5.0)
        received = len(rx.spans())
    dropped = counter(state, "export_dropped", ("otlp_traces",))
    assert dropped > 0 and received + dropped == n * SPANS_PER_INCIDENT
    assert counter(state, "export_failures", ("otlp_traces",)) == 0


def test_after_shutdown_nothing_is_recorded_and_flush_says_false():
    state = TelemetryState()
    with OtlpReceiver() as rx:
        ex = OtlpExporter(state, OtlpConfig(rx.endpoint, service_name="svc", export_interval_s=60.0, timeout_s=1.0))
        assert ex.config.service_name == "svc"
        ex.shutdown()
        ex.shutdown()  # idempotent
        ex.on_incident(fresh_incident())
        ex.on_step(summary(JOB, 0, 1, columns([0.1]), time_unix=time.time()))
        assert ex.force_flush(0.5) is False
        assert not rx.spans()
    assert counter(state, "export_failures", ("otlp_traces",)) == 0


def test_many_layers_do_not_hit_the_sdk_cardinality_limit():
    """3 ranks × 700 layers = 2100 series: above the SDK's default limit of 2000 per metric; the
    state bounds cardinality (max_series × max_layers), the SDK must not fold series into overflow."""
    state, names = TelemetryState(), tuple(f"layers.{i}" for i in range(700))
    with OtlpReceiver() as rx, running(state, rx.endpoint) as ex:
        for rank in range(3):
            state.observe_step(summary(JOB, rank, 1, columns([0.1] * len(names), names), time_unix=time.time()))
        assert ex.force_flush(5.0)
        points = _points(rx.latest("gradloc.grad.norm"))
    assert len(points) == 3 * len(names)
    assert not any(("otel.metric.overflow", True) in key for key in points)


def test_a_jobs_global_layer_series_arrive_once_with_rank_job():
    """DDP/FSDP2/ZeRO ranks send the same job-level layer columns: OTLP gets them once (rank="job"),
    the global-norm histogram once per step, and each rank's own loss under its rank."""
    state = TelemetryState()
    with OtlpReceiver() as rx:
        with running(state, rx.endpoint) as ex:
            for rank in (0, 1, 2):
                s = dataclasses.replace(summary(JOB, rank, 100, columns([0.5, 0.3, 0.2], LAYERS), time_unix=time.time(),
                                             loss=1.0 + rank), layers_global=True)
                state.observe_step(s)
                ex.on_step(s)
            assert ex.force_flush(5.0)
        metrics = {name: ms[-1] for name, ms in rx.metrics().items()}
    assert set(_by_rank_layer(metrics["gradloc.grad.norm"])) == {f"job/{layer}" for layer in LAYERS}
    assert [dict(k)["rank"] for k in _points(metrics["gradloc.grad.global_norm"])] == ["job"]
    assert {dict(k)["rank"]: p.as_double for k, p in _points(metrics["gradloc.loss"]).items()} == \
        {"0": 1.0, "1": 2.0, "2": 3.0}
    hist = _points(metrics["gradloc.step.grad_norm"])
    assert [(dict(k)["rank"], p.count) for k, p in hist.items()] == [("job", 1)]
