"""One incident id a user sees: the id the training process prints for its finding (the demo,
``StepReport.incident``, the JSONL file) is the correlated incident's own id (the lowest reporting rank's
finding; the other ranks' finding ids stay aliases), accepted by ``incidents show``, the JSON API and the
incident page; with a store and without one, in embedded mode and against a daemon."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradloc.agent.cli import main
from gradloc.agent.core import AgentCore, Declare
from gradloc.agent.http import AgentHttpServer
from gradloc.store import IncidentStore
from tests.agent.http_get import get
from tests.builders import rank_finding, rank_summary

ROOT = Path(__file__).resolve().parents[2]
PRINTED_ID = re.compile(r"^incident ([0-9a-f]{12}) · job ", re.MULTILINE)  # render.incident_text's first line


def _served(core: AgentCore):
    http = AgentHttpServer(core, "127.0.0.1:0").start()
    return http, "http://%s:%d" % http.address


def _feed(core: AgentCore, job: str, step: int, finding_id: str, rank: int = 0, world: int = 1) -> None:
    core.submit([Declare(job, r, world) for r in range(world)] +
                [replace(rank_finding(job, rank, step), incident_id=finding_id)] + [rank_summary(job, r, step) for r in range(world)])
    assert core.flush(10)


def _assert_resolves(base: str, key: str, incident_id: str) -> None:
    code, body = get(f"{base}/api/incidents/{key}")
    assert code == 200, body
    assert json.loads(body)["incident_id"] == incident_id
    code, body = get(f"{base}/incidents/{key}")
    assert code == 200 and incident_id[:12] in body.decode(), body[:300]


@pytest.mark.parametrize("with_store", [False, True])
def test_the_api_and_the_page_accept_a_finding_id(tmp_path: Path, with_store: bool) -> None:
    store = IncidentStore(tmp_path / "s.db") if with_store else None
    core = AgentCore(store=store).start()
    http, base = _served(core)
    try:
        _feed(core, "j", 3, "f1a2b3c4d5e6" + "0" * 20)
        _feed(core, "k", 4, "f1a9" + "1" * 28)
        ours = next(i for i in core.recent if i.job == "j")
        assert ours.incident_id == ours.findings[0].incident_id == "f1a2b3c4d5e6" + "0" * 20  # one id
        for key in ("f1a2b3c4d5e6" + "0" * 20, "f1a2b3c4d5e6", ours.incident_id, ours.incident_id[:10]):
            _assert_resolves(base, key, ours.incident_id)
        code, body = get(f"{base}/api/incidents/f1a")  # a finding of each incident
        assert code == 400 and "ambiguous" in json.loads(body)["error"]
        assert get(f"{base}/api/incidents/f1a2b3c4d5e7")[0] == 404  # no id starts so
    finally:
        http.stop()
        core.close()


def test_incidents_show_takes_a_finding_id_and_says_so(tmp_path: Path) -> None:
    """A one-process incident is known by its finding's id (no note); a rank-1 finding of a two-rank job
    whose rank 0 found nothing is too (the lowest reporting rank's); an id that is no 32-hex-digit id
    gets a fresh one, the finding's an alias that ``show`` resolves with a note."""
    db = tmp_path / "s.db"
    core = AgentCore(store=IncidentStore(db)).start()
    _feed(core, "j", 3, "5eed" * 8)
    _feed(core, "k", 4, "be11" * 8, rank=1, world=2)
    _feed(core, "m", 5, "not-hex-" * 4)
    core.close()
    with IncidentStore(db) as store:
        rows = {r.job: r for r in store.list_incidents()}
    assert (rows["j"].incident_id, rows["k"].incident_id) == ("5eed" * 8, "be11" * 8)
    for job, key in (("j", "5eed5eed5eed"), ("k", "be11be11be11")):
        res = CliRunner().invoke(main, ["incidents", "show", key, "--db", str(db), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["incident_id"] == rows[job].incident_id
        assert "names a rank finding" not in res.stderr  # its own id: no note
    other = rows["m"].incident_id
    assert other != "not-hex-" * 4 and re.fullmatch("[0-9a-f]{32}", other)
    res = CliRunner().invoke(main, ["incidents", "show", "not-hex-", "--db", str(db), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["incident_id"] == other
    assert f"not-hex- names a rank finding of incident {other}" in res.stderr


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "gradloc.agent.cli", "demo", *args], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=env)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    return res


def test_the_id_the_embedded_demo_prints_resolves(tmp_path: Path) -> None:
    """End to end: ``gradloc-agent demo --db`` (embedded mode), then the id it printed through
    ``incidents show`` and the agent's HTTP handlers on that store."""
    db = tmp_path / "demo.db"
    out = _demo("--db", str(db), "--seed", "0").stdout
    printed = PRINTED_ID.findall(out)
    assert printed, out
    for key in printed:
        res = CliRunner().invoke(main, ["incidents", "show", key, "--db", str(db), "--json"])
        assert res.exit_code == 0, res.output
        stored = json.loads(res.stdout)
        assert stored["incident_id"].startswith(key), (key, stored["incident_id"])  # the id printed is the stored one
        assert "names a rank finding" not in res.stderr
        core = AgentCore(store=IncidentStore(db, create=False))  # not started: the handlers only read the store
        http, base = _served(core)
        try:
            _assert_resolves(base, key, stored["incident_id"])
        finally:
            http.stop()
            core.store.close()


@pytest.mark.integration
def test_the_ids_a_demo_shipping_to_a_daemon_reports_resolve(tmp_path: Path) -> None:
    """End to end against a real daemon: the ids of the demo's ``--json`` output, through the
    daemon's API and page and ``incidents show`` on its store."""
    from tests.system.agent_proc import running_daemon

    with running_daemon(tmp_path) as daemon:
        doc = json.loads(_demo("--agent", daemon.ingest, "--json", "--seed", "0").stdout)
        ids = [inc["incident_id"] for inc in doc["incidents"]]
        assert ids, doc
        for key in ids:
            deadline = time.monotonic() + 60  # the daemon stores an incident after acknowledging it: poll
            while get(f"http://{daemon.http}/api/incidents/{key}")[0] != 200:
                assert time.monotonic() < deadline, f"the daemon never served incident {key}"
                time.sleep(0.2)
            code, body = get(f"http://{daemon.http}/api/incidents/{key[:12]}")
            assert code == 200, body
            assert json.loads(body)["incident_id"] == key  # the demo's own id is the daemon's
            assert get(f"http://{daemon.http}/incidents/{key[:12]}")[0] == 200
    for key in ids:
        res = CliRunner().invoke(main, ["incidents", "show", key[:12], "--db", str(daemon.db), "--json"])
        assert res.exit_code == 0, res.output
        assert key in [f["incident_id"] for f in json.loads(res.stdout)["findings"]]
