"""The agent's HTTP side on a core without a store: routes, the in-memory incident list, bad queries."""
from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gradloc.agent.core import AgentCore, Declare  # noqa: E402
from gradloc.agent.http import AgentHttpServer, parse_address  # noqa: E402
from tests.agent.http_get import get  # noqa: E402
from tests.builders import rank_finding, rank_summary  # noqa: E402


@pytest.fixture
def served():
    core = AgentCore().start()
    http = AgentHttpServer(core, "127.0.0.1:0").start()
    yield core, "http://%s:%d" % http.address
    http.stop()
    core.close()


def test_incidents_without_a_store_come_from_memory(served) -> None:
    core, base = served
    core.submit([Declare("j", 0, 1), rank_finding("j", 0, 3), rank_summary("j", 0, 3), rank_finding("k", 0, 4), rank_summary("k", 0, 4)])
    assert core.flush(10)
    code, body = get(base + "/api/incidents?job=j")
    rows = json.loads(body)
    assert code == 200 and [(r["job"], r["step"], r["status"]) for r in rows] == [("j", 3, "complete")]
    assert set(rows[0]) >= {"incident_id", "trace_id", "kinds", "ranks_missing", "probes"}
    code, body = get(base + f"/api/incidents/{rows[0]['incident_id'][:8]}")
    assert code == 200 and json.loads(body)["spans"][0]["span"]["text"] == " bad"
    assert [r["job"] for r in json.loads(get(base + "/api/incidents?limit=1")[1])] == ["k"]


def test_a_trace_id_redirects_to_its_incident_page(served) -> None:
    """The Grafana datasource's exemplar link: /incidents/trace/<trace id> -> /incidents/<incident id>."""
    core, base = served
    core.submit([Declare("j", 0, 1), rank_finding("j", 0, 3), rank_summary("j", 0, 3)])
    assert core.flush(10)
    row = json.loads(get(base + "/api/incidents")[1])[0]
    with urllib.request.urlopen(base + f"/incidents/trace/{row['trace_id']}", timeout=10) as resp:  # follows the 302
        assert resp.status == 200 and resp.url == base + f"/incidents/{row['incident_id']}"
        assert row["incident_id"][:12] in resp.read().decode()
    assert get(base + "/incidents/trace/" + "0" * 32)[0] == 404
    code, body = get(base + "/incidents/trace/../../etc")
    assert code in (400, 404) and b"Traceback" not in body
    code, body = get(base + "/incidents/trace/XYZ")
    assert code == 400 and "32 lowercase hex" in json.loads(body)["error"]


@pytest.mark.parametrize("path,code,needle", [
    ("/api/incidents?limit=0", 400, "limit must be in 1..10000"),
    ("/api/incidents?limit=x", 400, "limit must be an integer"),
    ("/api/incidents?since=yesterday", 400, "since must be a number"),
    ("/api/incidents/ffffffff", 404, "no such incident"),
    ("/nope", 404, "no route /nope"),
])
def test_bad_requests_get_clear_errors(served, path: str, code: int, needle: str) -> None:
    got, body = get(served[1] + path)
    assert got == code and needle in json.loads(body)["error"]


def test_metrics_and_health(served) -> None:
    core, base = served
    core.submit([rank_summary("j", 0, 1)])
    core.flush(10)
    code, body = get(base + "/metrics")
    assert code == 200 and b'gradloc_steps_total{job="j",rank="0"} 1.0' in body
    health = json.loads(get(base + "/healthz")[1])
    assert health["status"] == "ok" and health["store"] is False


@pytest.mark.parametrize("text,expected", [("127.0.0.1:80", ("127.0.0.1", 80)), (":0", ("127.0.0.1", 0)),
                                           ("9917", ("127.0.0.1", 9917)), ("[::1]:5", ("::1", 5))])
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["host:http", "host:70000"])
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="bad address"):
        parse_address(text)
