"""Every dashboard query executed by a real Prometheus 2.42 that scraped a real agent during real runs.

This checkout's daemon receives a core demo with a planted spike (incidents, localizations,
per-layer series) and an RL demo (RL fields) from real trainer processes, plus one malformed ingest
message (a rejection); it runs with ``--max-culprits 1`` and ``--max-layers 4`` so the limit and
series-drop counters have events. Prometheus scrapes its /metrics every second. The events a healthy demo never
produces come from a batch sent with the trainer's codec (a skipped step, non-finite gradients, a
shed feature, client drops, a re-sent batch: see ``_events``) and from an OTLP endpoint that refuses
every export (export failures and drops: ``_refusing_collector``). Each panel query (variables substituted
as "All") then runs as a range query over the runs: every one must return at least one series.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from gradloc.records import PrecursorFinding, SampleOutlier, SampleStats
from tests.builders import incident_record, layer, precursor_stats, step_record
from tests.grafana.promql import queries
from tests.reliability.daemon import ROOT, serving
from tests.system.prom import running_prometheus
from tests.transport.factories import client_info, encode

EVENT_JOB = "dash-ev"


def _events(ingest: str) -> None:
    """The events a healthy demo never produces, sent with the trainer's own codec over gRPC: a
    GradScaler-skipped step, a step with non-finite gradients, a step that shed a feature, a client
    reporting drops, a batch with an incident sent twice (a re-send after a lost acknowledgement) whose
    culprits are over the daemon's --max-culprits, a step with a per-sample outlier finding (a
    healthy demo has none), per-head precursor values and a MoE router's (the demo measures neither), a precursor
    finding (the demo is shorter than the drift detector's warm-up).
    The OTLP exporters' failures and drops come from the daemon's --otlp-endpoint, which refuses every export."""
    now = time.time()
    bad = layer("head", float("inf"), nonfinite=2)
    outlier = SampleOutlier(kind="surprise", job=EVENT_JOB, rank=1, step=4, time_unix=now, score=8.9, z=11.0,
                            baseline=3.5, micro_batch=0, sample=1, sample_id="uid-7", start=0, end=64, tokens=64)
    drifting = PrecursorFinding(job=EVENT_JOB, rank=1, step=4, time_unix=now, statistic="attn_entropy",
                                layer="layers.1.attn", trend="falling", value=0.4, baseline=1.2, z=9.0, change=0.33,
                                rate=2.0, since_step=1)  # a drift finding (the demo runs too short for one)
    steps = [step_record(0, job=EVENT_JOB, time_unix=now, skipped=True),
             step_record(1, job=EVENT_JOB, time_unix=now, layers=(layer("embed"), bad), nonfinite=2,
                  global_norm=float("inf")),
             step_record(2, job=EVENT_JOB, time_unix=now, shed=("update_ratio",)),
             step_record(4, job=EVENT_JOB, time_unix=now, samples=SampleStats(judged=16, flagged=1, outliers=(outlier,)),
                         precursor_findings=(drifting,),
                         precursors=tuple(p for p in precursor_stats(layers=1, heads=1) if p.kind == "attn_entropy"
                                          or p.head is not None)),  # --max-layers 4 keeps the demo's first 4
             # a MoE model's routers (the demo has none): another rank, so its latest step holds them (--max-layers 4)
             step_record(5, job=EVENT_JOB, rank=0, time_unix=now,
                         precursors=tuple(p for p in precursor_stats() if "moe" in p.layer)[:4])]
    two = incident_record(3, job=EVENT_JOB, time_unix=now)  # two culprits: --max-culprits 1 cuts one (limited)
    two = dataclasses.replace(two, localization=dataclasses.replace(
        two.localization, culprits=two.localization.culprits * 2, spans=two.localization.spans * 2))
    msg, _ = encode(steps, [two],
                    client=client_info(job=EVENT_JOB, rank=1, world_size=2, client_id="dash-events"))
    msg.drops.queue_full = 3
    with grpc.insecure_channel(ingest) as ch:
        call = ch.unary_unary("/gradloc.v1.IngestService/Ingest")
        for _ in range(2):  # the same (client id, sequence) twice: the incident is stored once
            call(msg.SerializeToString(), timeout=30)


def _demo(ingest: str, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "gradloc.agent.cli", "demo", "--agent", ingest, *args],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]


def test_every_panel_query_runs_against_prometheus(tmp_path: Path) -> None:
    with _refusing_collector() as otlp, serving(
            tmp_path, "--ingest", "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", str(tmp_path / "a.db"),
            "--straggler-deadline-s", "1", "--max-culprits", "1", "--max-layers", "4",
            "--otlp-endpoint", otlp, "--otlp-interval-s", "1") as agent:
        with running_prometheus([agent["http"]]) as prom:
            start = time.time()
            with grpc.insecure_channel(agent["ingest"]) as ch:  # one rejection for the agent-health panels
                with pytest.raises(grpc.RpcError):
                    ch.unary_unary("/gradloc.v1.IngestService/Ingest")(b"\xff\xff not a batch", timeout=10)
            _events(agent["ingest"])
            _demo(agent["ingest"], "--steps", "60", "--inject-step", "50", "--job", "dash")
            _demo(agent["ingest"], "--rl", "--steps", "80", "--inject-step", "60", "--job", "dash-rl")
            prom.wait_for('gradloc_incidents_total{job="dash"}', timeout=30)
            prom.wait_for("gradloc_export_failures_total", timeout=120)  # the refused OTLP exports
            time.sleep(3)  # a few more scrapes after the runs
            end = time.time()
            failed = []
            for uid, title, expr in queries():
                if not prom.api("query_range", query=expr, start=start, end=end, step=2)["result"]:
                    failed.append((uid, title, expr))
            # the datasource's exemplar link: a trace id Prometheus stored leads to the incident's page
            series = prom.exemplars('gradloc_incidents_total{job="dash"}', start, end)
            trace_ids = {e["labels"]["trace_id"] for x in series for e in x["exemplars"]}
            assert trace_ids, series
            for trace_id in trace_ids:
                with urllib.request.urlopen(f"http://{agent['http']}/incidents/trace/{trace_id}", timeout=30) as resp:
                    page = resp.read().decode()
                assert resp.status == 200 and "/incidents/" in resp.url and trace_id in page
    assert not failed, "queries with no data:\n" + "\n".join(f"{u} / {t}: {e}" for u, t, e in failed)


@contextlib.contextmanager
def _refusing_collector() -> Iterator[str]:
    """A gRPC server on loopback that serves no method, as the daemon's OTLP collector: every metric and span
    export fails at once (UNIMPLEMENTED, which the OTLP exporter does not retry) and is counted as a failure and
    its spans as dropped. (A port where nothing listens fails the same way, but the exporter retries a refused
    connection until its timeout, and the daemon's shutdown then waited ~8 s on the last export.)"""
    server = grpc.server(ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)
