"""Every dashboard query executed by a real Prometheus 2.42 that scraped a real agent during real runs.

This checkout's daemon receives a core demo with a planted spike (incidents, localizations,
per-layer series) and an RL demo (RL fields) from real trainer processes, plus one malformed ingest
message (a rejection); it runs with ``--max-culprits 1`` and ``--max-layers 4`` so the limit and
series-drop counters have events. Prometheus scrapes its /metrics every second. Each panel query
(variables substituted as "All") then runs as a range query over the runs: it must return at least
one series, except the queries over NEEDS_EVENT metrics only, which count events these runs do not
produce (Prometheus must still accept them: an error fails the test).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from tests.grafana.promql import metric_names, queries
from tests.integration.prom import running_prometheus
from tests.reliability.daemon import ROOT, serving

NEEDS_EVENT = {  # metric: the event none of these runs produces (its queries must be empty, not errors)
    "gradloc_skipped_steps_total": "a GradScaler-skipped step",
    "gradloc_nonfinite_steps_total": "a non-finite gradient",
    "gradloc_client_dropped_total": "a trainer-side client dropping records",
    "gradloc_export_failures_total": "a failing OTLP or store export",
    "gradloc_export_dropped_total": "an exporter dropping items",
    "gradloc_shed": "gradloc shedding a feature to stay within max_overhead",
    "gradloc_agent_duplicates_total": "a batch re-sent after a lost acknowledgement",
}


def _demo(ingest: str, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "gradloc.agent.cli", "demo", "--agent", ingest, *args],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]


def test_every_panel_query_runs_against_prometheus(tmp_path: Path) -> None:
    with serving(tmp_path, "--ingest", "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", str(tmp_path / "a.db"),
                 "--straggler-deadline-s", "1", "--max-culprits", "1", "--max-layers", "4") as agent:
        with running_prometheus([agent["http"]]) as prom:
            start = time.time()
            with grpc.insecure_channel(agent["ingest"]) as ch:  # one rejection for the agent-health panels
                with pytest.raises(grpc.RpcError):
                    ch.unary_unary("/gradloc.v1.IngestService/Ingest")(b"\xff\xff not a batch", timeout=10)
            _demo(agent["ingest"], "--steps", "60", "--inject-step", "50", "--job", "dash")
            _demo(agent["ingest"], "--rl", "--steps", "80", "--inject-step", "60", "--job", "dash-rl")
            prom.wait_for('gradloc_incidents_total{job="dash"}', timeout=30)
            time.sleep(3)  # a few more scrapes after the runs
            end = time.time()
            empty, failed = [], []
            for uid, title, expr in queries():
                data = prom.api("query_range", query=expr, start=start, end=end, step=2)
                if data["result"]:
                    continue
                (empty if metric_names(expr) <= set(NEEDS_EVENT) else failed).append((uid, title, expr))
            # the datasource's exemplar link: a trace id Prometheus stored leads to the incident's page
            series = prom.exemplars('gradloc_incidents_total{job="dash"}', start, end)
            trace_ids = {e["labels"]["trace_id"] for x in series for e in x["exemplars"]}
            assert trace_ids, series
            for trace_id in trace_ids:
                with urllib.request.urlopen(f"http://{agent['http']}/incidents/trace/{trace_id}", timeout=30) as resp:
                    page = resp.read().decode()
                assert resp.status == 200 and "/incidents/" in resp.url and trace_id in page
    assert not failed, "queries with no data:\n" + "\n".join(f"{u} / {t}: {e}" for u, t, e in failed)
    print(f"{sum(1 for _ in queries())} queries, {len(empty)} empty as listed: {sorted({t for _, t, _ in empty})}")
