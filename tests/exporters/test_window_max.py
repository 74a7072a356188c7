"""Window maxima (``gradloc_grad_global_norm_max``, ``gradloc_loss_max``): the largest value over the steps since
the reading exporter's previous collection, so a one-step spike between two scrapes is not missed.

The Prometheus side is read through the real collector and the text a scrape returns; the OTLP side through the
real OTel SDK (an in-memory reader collecting the same instruments the OTLP exporter registers). A real
Prometheus scraping a real daemon: tests/system/test_window_max_prometheus.py.
"""
from __future__ import annotations

import dataclasses
import math
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from gradloc.exporters.otlp_metrics import MetricInstruments
from gradloc.exporters.prometheus import make_registry, render
from gradloc.exporters.state import TelemetryState
from tests.builders import NAN, columns, summary


def _step(n: int, norm: float, loss: float | None = 2.0, rank: int = 0, job: str = "j", **kw):
    return summary(job, rank, n, columns([norm]), time_unix=time.time(), global_norm=norm, loss=loss, **kw)


def _scrape(registry) -> dict[str, dict[str, float]]:
    """{sample name: {rank: value}} of the norm and loss gauges in one scrape's text."""
    from prometheus_client.parser import text_string_to_metric_families as parse_text
    out: dict[str, dict[str, float]] = {}
    names = {"gradloc_grad_global_norm", "gradloc_grad_global_norm_max", "gradloc_loss", "gradloc_loss_max"}
    for fam in parse_text(render(registry, None)[0].decode()):
        for s in fam.samples:
            if s.name in names:
                out.setdefault(s.name, {})[s.labels["rank"]] = s.value
    return out


def test_a_one_step_spike_between_two_scrapes_shows_in_the_max_not_in_the_latest():
    state = TelemetryState()
    registry = make_registry(state)
    for n, norm in enumerate([1.0, 1.1, 9.5, 1.2, 0.9]):  # the spike is neither the first nor the last step
        state.observe_step(_step(n, norm, loss=3.0 if n == 2 else 2.0))
    got = _scrape(registry)
    assert got["gradloc_grad_global_norm"] == {"0": 0.9}  # the latest step: the spike is missed
    assert got["gradloc_grad_global_norm_max"] == {"0": 9.5}
    assert got["gradloc_loss"] == {"0": 2.0} and got["gradloc_loss_max"] == {"0": 3.0}


def test_the_window_restarts_at_each_scrape_and_a_scrape_without_a_step_repeats_the_latest_value():
    """Scrapes faster than steps: the max is the latest step's value, never 0 and never a gap; the spike
    of a previous window does not linger."""
    state = TelemetryState()
    registry = make_registry(state)
    state.observe_step(_step(0, 7.0))
    state.observe_step(_step(1, 1.5))
    assert _scrape(registry)["gradloc_grad_global_norm_max"] == {"0": 7.0}
    for _ in range(3):  # no step since
        got = _scrape(registry)
        assert got["gradloc_grad_global_norm_max"] == {"0": 1.5} and got["gradloc_loss_max"] == {"0": 2.0}
    state.observe_step(_step(2, 0.5))
    assert _scrape(registry)["gradloc_grad_global_norm_max"] == {"0": 0.5}  # a lower step after the window


def test_prometheus_and_otlp_keep_their_own_windows():
    """An OTLP export (reader "otlp") must not empty the scrape's window, nor the reverse; a snapshot
    without a reader empties nothing."""
    state = TelemetryState()
    registry = make_registry(state)
    provider_reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[provider_reader])
    MetricInstruments(provider.get_meter("test"), state)

    def otlp_max() -> dict[str, float]:
        data = provider_reader.get_metrics_data()
        return {p.attributes["rank"]: p.value for rm in data.resource_metrics for sm in rm.scope_metrics
                for m in sm.metrics if m.name == "gradloc.grad.global_norm_max" for p in m.data.data_points}

    for n, norm in enumerate([1.0, 8.0, 1.0]):
        state.observe_step(_step(n, norm))
    state.snapshot()  # no reader: takes nothing
    assert otlp_max() == {"0": 8.0}
    assert _scrape(registry)["gradloc_grad_global_norm_max"] == {"0": 8.0}  # the OTLP export took nothing
    state.observe_step(_step(3, 6.0))
    state.observe_step(_step(4, 1.0))
    assert _scrape(registry)["gradloc_grad_global_norm_max"] == {"0": 6.0}
    assert otlp_max() == {"0": 6.0}  # its own window: steps 3 and 4, though the scrape took them too
    assert otlp_max() == {"0": 1.0}  # no step since: the latest step's value
    provider.shutdown()


def test_a_nan_norm_in_the_window_makes_the_max_nan_until_the_next_scrape():
    state = TelemetryState()
    registry = make_registry(state)
    for n, norm in enumerate([1.0, NAN, 2.0]):
        state.observe_step(_step(n, norm))
    assert math.isnan(_scrape(registry)["gradloc_grad_global_norm_max"]["0"])
    state.observe_step(_step(3, 1.0))
    assert _scrape(registry)["gradloc_grad_global_norm_max"] == {"0": 1.0}


def test_a_step_without_a_loss_keeps_the_window_s_loss():
    state = TelemetryState()
    registry = make_registry(state)
    state.observe_step(_step(0, 1.0, loss=4.0))
    state.observe_step(_step(1, 1.0, loss=None))
    got = _scrape(registry)
    assert got["gradloc_loss_max"] == {"0": 4.0} and "gradloc_loss" not in got


def test_a_job_with_global_layer_statistics_exports_the_norm_max_once_and_each_rank_its_loss_max():
    state = TelemetryState()
    registry = make_registry(state)
    for n, norm in enumerate([1.0, 5.0, 1.0]):
        for rank in range(3):
            state.observe_step(dataclasses.replace(_step(n, norm, loss=2.0 + rank + (n == 1), rank=rank, job="ddp"),
                                                   layers_global=True))
    got = _scrape(registry)
    assert got["gradloc_grad_global_norm_max"] == {"job": 5.0}
    assert got["gradloc_loss_max"] == {"0": 3.0, "1": 4.0, "2": 5.0}


def test_forgotten_and_stale_ranks_take_their_windows_with_them():
    state = TelemetryState()
    registry = make_registry(state)
    state.observe_step(_step(0, 9.0, job="gone"))
    state.forget(jobs=["gone"])
    state.observe_step(_step(0, 1.0, job="gone"))  # the job comes back: a fresh window, not the old 9
    assert _scrape(registry)["gradloc_grad_global_norm_max"] == {"0": 1.0}


def test_an_unknown_reader_is_refused():
    with pytest.raises(ValueError, match="unknown snapshot reader"):
        TelemetryState().snapshot(reader="grafana")
