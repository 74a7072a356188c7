"""The daemon end to end: real processes, real gRPC, a real Prometheus 2.42 scraping it.

No mocks: the trainer is ``gradloc-agent demo --agent`` in its own process, the daemon is
``gradloc-agent serve`` in another, Prometheus is the Debian binary.
"""
from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from tests.system.agent_proc import AGENT, run_demo, running_daemon
from tests.system.prom import running_prometheus

INGEST_METHOD = "/gradloc.v1.IngestService/Ingest"


def _planted(demo_stdout: str) -> dict:
    (p,) = json.loads(demo_stdout)["planted"]
    return p


def test_demo_through_the_daemon_scraped_by_prometheus(tmp_path: Path) -> None:
    with running_daemon(tmp_path, "--straggler-deadline-s", "3") as agent, \
            running_prometheus([agent.http], scrape_interval="1s") as prom:
        demo = run_demo("--agent", agent.ingest, "--json", "--job", "demo-it")
        planted = _planted(demo.stdout)

        # Every step record reached the daemon and Prometheus scraped it.
        prom.wait_for('gradloc_steps_total{job="demo-it"}', lambda r: r and float(r[0]["value"][1]) == 200,
                      timeout=30)
        layers = prom.query('gradloc_grad_norm{job="demo-it"}')
        assert len(layers) >= 5 and all(float(r["value"][1]) > 0 for r in layers)
        assert {r["metric"]["rank"] for r in layers} == {"0"}

        # One correlated incident at the planted step, with the planted token as its top span.
        incidents = agent.json("/api/incidents?job=demo-it")
        at_plant = [i for i in incidents if i["step"] == 180]
        assert len(at_plant) == 1, incidents
        full = agent.json(f"/api/incidents/{at_plant[0]['incident_id']}")
        assert full["status"] == "complete" and full["ranks_missing"] == []
        top = full["spans"][0]
        assert (top["span"]["micro_batch"], top["span"]["sample"], top["span"]["start"]) == \
            (planted["micro_batch"], planted["sample"], planted["position"])

        # The exemplar Prometheus stored for the incident counter carries the incident's trace id.
        prom.wait_for('gradloc_incidents_total{job="demo-it"}', timeout=20)
        now = time.time()
        series = prom.exemplars('gradloc_incidents_total{job="demo-it"}', now - 600, now + 60)
        trace_ids = {e["labels"]["trace_id"] for s in series for e in s["exemplars"]}
        assert full["trace_id"] in trace_ids or any(i["trace_id"] in trace_ids for i in incidents)

        # The exposition passes promtool, and the CLI reads the same store while the daemon runs.
        text, _ = agent.get("/metrics")
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
        assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), check
        listed = subprocess.run([AGENT, "incidents", "list", "--db", str(agent.db), "--json", "--job", "demo-it"],
                                capture_output=True, text=True, check=True)
        assert full["incident_id"] in {r["incident_id"] for r in json.loads(listed.stdout)}


def test_ranks_in_separate_processes_become_one_incident_naming_the_missing_rank(tmp_path: Path) -> None:
    """Three of four ranks run (rank 3 never starts); only rank 1 plants a culprit.

    Ranks 0 and 2 finish before rank 1 starts (ordered, not raced: on a loaded machine a rank running
    alongside could report the incident's step after the straggler deadline and be named missing too).
    Their step records for the incident's step are in the daemon's history when rank 1's finding
    arrives, so the only rank the incident waits for is the one that never runs."""
    with running_daemon(tmp_path, "--straggler-deadline-s", "2") as agent:
        def rank(r: int) -> subprocess.CompletedProcess[str]:
            inject = "advantage" if r == 1 else "none"
            return run_demo("--agent", agent.ingest, "--json", "--job", "ddp", "--rank", str(r),
                            "--world-size", "4", "--seed", str(r), "--inject", inject, "--steps", "200")

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(rank, (0, 2)))
        planted = _planted(rank(1).stdout)
        deadline = time.monotonic() + 20
        while True:
            incidents = [i for i in agent.json("/api/incidents?job=ddp") if i["step"] == 180]
            if incidents or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(incidents) == 1, incidents
        full = agent.json(f"/api/incidents/{incidents[0]['incident_id']}")
        assert full["status"] == "partial" and full["ranks_missing"] == [3]
        assert full["ranks_expected"] == [0, 1, 2, 3] and full["ranks_reported"] == [0, 1, 2]
        shares = {r["rank"]: r["share"] for r in full["rank_shares"]}
        assert shares[1] > 0.5 and abs(sum(shares.values()) - 1) < 1e-6
        top = full["spans"][0]
        assert top["rank"] == 1 and top["span"]["start"] == planted["position"]
        missing = float(agent.get("/metrics")[0].decode().split('gradloc_incident_missing_ranks_total{job="ddp"} ')[1]
                        .split()[0])
        assert missing >= 1


def test_bad_input_is_rejected_and_counted_and_the_daemon_keeps_serving(tmp_path: Path) -> None:
    with running_daemon(tmp_path) as agent:
        with grpc.insecure_channel(agent.ingest) as channel:
            call = channel.unary_unary(INGEST_METHOD)  # raw bytes in and out
            try:
                call(b"\xff\x00 not a protobuf", timeout=5)
                raise AssertionError("malformed bytes were accepted")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert agent.json("/healthz")["status"] == "ok"
        text = agent.get("/metrics")[0].decode()
        assert 'gradloc_agent_rejected_total{reason="malformed"} 1.0' in text
        run_demo("--agent", agent.ingest, "--json", "--steps", "30", "--inject-step", "26", "--job", "after")
        assert 'gradloc_steps_total{job="after",rank="0"} 30.0' in agent.get("/metrics")[0].decode()


def test_daemon_forwards_metrics_and_the_incident_trace_over_otlp(tmp_path: Path) -> None:
    """``serve --otlp-endpoint`` against a real OTLP/gRPC receiver (opentelemetry-proto servicers)."""
    from tests.exporters.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        with running_daemon(tmp_path, "--otlp-endpoint", receiver.endpoint, "--otlp-interval-s", "0.5",
                            "--straggler-deadline-s", "2") as agent:
            run_demo("--agent", agent.ingest, "--json", "--job", "otlp-it")
            deadline = time.monotonic() + 20
            while not agent.json("/api/incidents?job=otlp-it") and time.monotonic() < deadline:
                time.sleep(0.2)
            incidents = agent.json("/api/incidents?job=otlp-it")
            (inc,) = [i for i in incidents if i["step"] == 180]
        # SIGTERM flushed the exporters: the trace and the exemplar are at the receiver now.
        trace_id = bytes.fromhex(inc["trace_id"])
        roots = [s for s in receiver.spans() if s.name == "gradloc.incident" and s.trace_id == trace_id]
        assert len(roots) == 1
        events = [e for s in receiver.spans() if s.trace_id == trace_id for e in s.events if e.name == "culprit_span"]
        assert events, "no culprit_span event in the incident's trace"
        metrics = receiver.metrics()
        assert metrics["gradloc.grad.norm"][-1].unit == "1"
        exemplars = {e.trace_id for m in metrics["gradloc.incident.count"] for p in m.sum.data_points
                     for e in p.exemplars}
        # Each export carries the latest incident's exemplar: every one is an incident's trace id
        # (read from the store after shutdown: incidents closed after the API call count too).
        from gradloc.store.sqlite import IncidentStore

        with IncidentStore(agent.db) as store:
            stored = {bytes.fromhex(r.trace_id) for r in store.list_incidents(job="otlp-it", limit=1000)}
        assert exemplars and exemplars <= stored and trace_id in stored


def test_shutdown_flushes_open_incidents_as_partial(tmp_path: Path) -> None:
    """Rank 1 of 2 never reports and the deadline is far: SIGTERM must still store the incident."""
    from gradloc.store.sqlite import IncidentStore

    with running_daemon(tmp_path, "--straggler-deadline-s", "600") as agent:
        run_demo("--agent", agent.ingest, "--json", "--job", "flush", "--world-size", "2")
        time.sleep(0.5)
        assert agent.json("/api/incidents?job=flush") == []  # still waiting for rank 1
        assert agent.json("/healthz")["pending_incidents"] >= 1
    with IncidentStore(agent.db) as store:
        rows = store.list_incidents(job="flush", limit=1000)
        at_plant = [store.get_incident(r.incident_id) for r in rows if r.step == 180]
    assert len(at_plant) == 1 and at_plant[0].status == "partial" and at_plant[0].ranks_missing == (1,)
    assert "shut down" in at_plant[0].note
