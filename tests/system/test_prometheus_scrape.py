"""A real Prometheus 2.42 scrapes gradloc's exposition; the numbers come back through PromQL.

The target is a small HTTP server answering ``/metrics`` with :func:`render` — the daemon's own
path, content negotiation included — so this checks that Prometheus accepts our OpenMetrics
(exemplars, UNIT lines, NaN values), that gradloc's ``job`` label survives with ``honor_labels``,
and that counters, histograms and exemplars are queryable as dashboards will query them.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from gradloc.exporters.prometheus import make_registry, render
from gradloc.exporters.state import TelemetryState
from tests.builders import NAN, TRACE_ID, columns, correlated, layer_names, summary
from tests.system.prom import running_prometheus

JOB, RANKS, LAYERS = "llm-7b", 2, 8
NORMS = np.array([0.5, 1.0, 2.0, NAN, 0.25, 0.125, 3.0, 1e-6])  # layer 3 has a NaN gradient norm
STEP_NORM = 5.0  # every step's global norm: bucket (3.16, 10]


@contextlib.contextmanager
def serving(state: TelemetryState) -> Iterator[tuple[str, list[str]]]:
    """``/metrics`` on a free port; yields ("host:port", content types served so far)."""
    registry, served = make_registry(state), []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body, ctype = render(registry, self.headers.get("Accept"))
            served.append(ctype)
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_port}", served
    finally:
        server.shutdown()
        server.server_close()


def observe_steps(state: TelemetryState, rank: int, steps: range) -> None:
    for n in steps:
        state.observe_step(summary(JOB, rank, n, columns(NORMS * (rank + 1)), time_unix=time.time(),
                                global_norm=STEP_NORM))


def value(row: dict) -> float:
    return float(row["value"][1])


def by_rank(rows: list[dict]) -> dict[str, float]:
    return {r["metric"]["rank"]: value(r) for r in rows}


@pytest.fixture
def state() -> TelemetryState:
    state = TelemetryState()
    for rank in range(RANKS):
        observe_steps(state, rank, range(1, 2))
    state.observe_incident(correlated(JOB, 1, trace_id=TRACE_ID, global_norm=STEP_NORM, ranks=range(RANKS)))
    return state


def test_prometheus_scrapes_values_counters_histograms_and_exemplars(state: TelemetryState):
    t_start = time.time()
    with serving(state) as (target, served), running_prometheus([target]) as prom:
        norms = prom.wait_for("gradloc_grad_norm", lambda r: len(r) == RANKS * LAYERS)
        assert {r["metric"]["job"] for r in norms} == {JOB}  # honor_labels kept gradloc's job label
        assert not any("exported_job" in r["metric"] for r in norms)

        layer = layer_names(LAYERS)[6]
        assert by_rank(prom.query(f'gradloc_grad_norm{{layer="{layer}"}}')) == {"0": 3.0, "1": 6.0}
        nan_rows = prom.query(f'gradloc_grad_norm{{layer="{layer_names(LAYERS)[3]}"}}')
        assert len(nan_rows) == RANKS and all(math.isnan(value(r)) for r in nan_rows)

        # Counters move when more steps arrive.
        assert by_rank(prom.query("gradloc_steps_total")) == {"0": 1.0, "1": 1.0}
        observe_steps(state, 0, range(2, 5))
        prom.wait_for('gradloc_steps_total{rank="0"}', lambda r: len(r) == 1 and value(r[0]) == 4.0)
        assert prom.query('gradloc_step{rank="0"}')[0]["value"][1] == "4"

        # Histogram: every bucket is a series, and quantiles land in the bucket of the norms observed.
        buckets = prom.query('gradloc_step_grad_norm_bucket{rank="0"}')
        assert len(buckets) == 26
        quantile = ('histogram_quantile(0.5, sum by (le) '
                    '(increase(gradloc_step_grad_norm_bucket{rank="0"}[30s])))')
        q = prom.wait_for(quantile, lambda r: len(r) == 1 and math.isfinite(value(r[0])) and value(r[0]) > 0)
        assert 3.16 < value(q[0]) <= 10.0

        # The incident's trace id travels as an exemplar (Prometheus scraped OpenMetrics for it).
        end = time.time() + 60
        found = prom.exemplars("gradloc_incidents_total", t_start - 60, end)
        assert [(s["seriesLabels"]["job"], s["seriesLabels"]["status"]) for s in found] == [(JOB, "complete")]
        assert [e["labels"] for e in found[0]["exemplars"]] == [{"trace_id": TRACE_ID}]
        hist_ex = prom.exemplars('gradloc_step_grad_norm_bucket{rank="1"}', t_start - 60, end)
        assert [(s["seriesLabels"]["le"], e["labels"]["trace_id"], float(e["value"]))
                for s in hist_ex for e in s["exemplars"]] == [("10.0", TRACE_ID, STEP_NORM)]

        targets = prom.targets()
        assert [(t["health"], t["lastError"]) for t in targets] == [("up", "")]
        assert served and all(c.startswith("application/openmetrics-text") for c in served)


def test_without_honor_labels_prometheus_renames_gradlocs_job(state: TelemetryState):
    """Why docs/metrics.md asks for ``honor_labels: true``: otherwise ``job`` is the scrape job's."""
    with serving(state) as (target, _), running_prometheus([target], honor_labels=False) as prom:
        rows = prom.wait_for("gradloc_grad_global_norm", lambda r: len(r) == RANKS)
        assert {(r["metric"]["job"], r["metric"]["exported_job"]) for r in rows} == {("gradloc", JOB)}
