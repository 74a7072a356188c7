"""``gradloc-agent incidents …`` follows the daemon (issue 33, item 3), and the daemon logs each incident
it closes (item 6).

Against a real ``gradloc-agent serve`` subprocess on free, non-default ports with an auth token: an
incident shipped over gRPC by the real client is read through ``--agent HOST:PORT``, through the same
environment and the same config file the daemon reads, and the page link ``show`` prints opens in a
client without the token. Without a daemon: each fallback says which store it read, or that there is
none, naming the address that did not answer.
"""
from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradloc.agent.cli import main
from gradloc.agent.core import AgentCore, Declare
from gradloc.agent.incident_log import IncidentLog
from gradloc.store import IncidentStore
from tests.agent.http_get import get
from tests.builders import rank_finding, rank_summary

TOKEN = "cli33-token-" + "x" * 20
JOB = "cli33"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp: Path, **extra: str | None) -> dict[str, str | None]:
    """A clean CLI environment: no store or config leaking in from the machine running the tests."""
    return {"GRADLOC_DB": None, "GRADLOC_AGENT_CONFIG": None, "GRADLOC_AGENT_HTTP": None, "GRADLOC_AGENT_DB": None,
            "GRADLOC_AGENT_AUTH_TOKEN": None, "XDG_STATE_HOME": str(tmp / "state"), **extra}


def _cli(*args: str, env: dict[str, str | None]):
    return CliRunner().invoke(main, ["incidents", *args], env=env)


@pytest.mark.integration
def test_the_cli_reads_the_daemon_it_is_pointed_at_and_its_links_open(tmp_path: Path) -> None:
    from gradloc.transport.client import AgentClient
    from tests.system.agent_proc import running_daemon

    with running_daemon(tmp_path, env={"GRADLOC_AGENT_AUTH_TOKEN": TOKEN}) as daemon:
        port = int(daemon.http.rpartition(":")[2])
        assert port != 9917
        client = AgentClient(daemon.ingest, job=JOB, rank=0, token=TOKEN)
        client.on_incident(rank_finding(JOB, 0, 7, text=" bad"))
        assert client.force_flush(30)
        client.shutdown(10)
        base = f"http://{daemon.http}"
        auth = _env(tmp_path, GRADLOC_AGENT_AUTH_TOKEN=TOKEN)
        deadline = time.monotonic() + 60  # stored after the acknowledgement and the straggler deadline: poll
        while True:
            res = _cli("list", "--agent", daemon.http, "--json", env=auth)
            assert res.exit_code == 0, res.output
            rows = json.loads(res.stdout)
            if rows:
                break
            assert time.monotonic() < deadline, "the daemon never listed the incident"
            time.sleep(0.3)
        (row,) = rows
        incident_id = row["incident_id"]
        assert row["job"] == JOB and row["step"] == 7

        # --agent: the daemon's API, and a link to this daemon's port, signed, that opens without the token
        show = _cli("show", incident_id[:12], "--agent", daemon.http, "--no-color", env=auth)
        assert show.exit_code == 0, show.output
        assert f"incident {incident_id[:12]} · job {JOB} · step 7" in show.stdout and "[[ bad]]" in show.stdout
        (link,) = re.findall(r"^page: (\S+)$", show.stderr, re.MULTILINE)
        assert link.startswith(f"{base}/incidents/{incident_id}?sig="), link
        code, body = get(link)
        assert code == 200 and incident_id[:12] in body.decode()
        assert get(f"{base}/incidents/{incident_id}")[0] == 401  # the page itself is behind the token

        # the environment the daemon reads (GRADLOC_AGENT_HTTP), then its config file: no flag needed
        config = tmp_path / "agent.toml"
        config.write_text(f'[agent]\nhttp = "{daemon.http}"\nauth_token = "{TOKEN}"\n', encoding="utf-8")
        for env in (_env(tmp_path, GRADLOC_AGENT_HTTP=daemon.http, GRADLOC_AGENT_AUTH_TOKEN=TOKEN),
                    _env(tmp_path, GRADLOC_AGENT_CONFIG=str(config))):
            res = _cli("show", incident_id[:12], "--json", env=env)
            assert res.exit_code == 0, res.output
            assert json.loads(res.stdout)["incident_id"] == incident_id
            assert f"reading the agent at {base}" in res.stderr
            (link,) = re.findall(r"^page: (\S+)$", res.stderr, re.MULTILINE)
            assert link.startswith(f"{base}/incidents/{incident_id}?sig=") and get(link)[0] == 200

        listed = _cli("list", env=_env(tmp_path, GRADLOC_AGENT_CONFIG=str(config)))
        assert listed.exit_code == 0 and incident_id[:12] in listed.stdout, listed.output
        exported = _cli("export", "--agent", daemon.http, env=auth)
        assert exported.exit_code == 0, exported.output
        assert [json.loads(line)["incident_id"] for line in exported.stdout.splitlines()] == [incident_id]
        page = tmp_path / "page.html"
        res = _cli("show", incident_id, "--agent", daemon.http, "--html", str(page), env=auth)
        assert res.exit_code == 0 and incident_id[:12] in page.read_text(encoding="utf-8"), res.output
        missing = _cli("show", "ffffffffffff", "--agent", daemon.http, env=auth)
        assert missing.exit_code == 1 and f"no incident 'ffffffffffff' at the agent {base}" in missing.output

        # without the token the daemon refuses, and the CLI says what it needs
        res = _cli("list", "--agent", daemon.http, env=_env(tmp_path))
        assert res.exit_code == 1 and f"the agent at {base} refused the request (401)" in res.output
        assert "GRADLOC_AGENT_AUTH_TOKEN" in res.output

    # item 6: one info line per incident, with what a reader needs, the link unsigned (a log is no place for one)
    lines = [ln for ln in daemon.log.read_text().splitlines() if "gradloc-agent: incident " in ln]
    assert len(lines) == 1, lines
    assert " INFO " in lines[0]
    assert f"incident {incident_id} job {JOB} step 7 complete · located at the token level: micro-batch 1 · sample 0" \
        in lines[0], lines[0]
    assert lines[0].endswith(f"position 7 ' bad' · 80.0% of ‖∇‖² · 1 probe(s) · {base}/incidents/{incident_id}"), lines[0]
    assert "sig=" not in lines[0]


def test_an_agent_that_does_not_answer_is_named_with_the_store_read_instead(tmp_path: Path) -> None:
    port = _free_port()  # nothing listens there
    store_path = tmp_path / "node.db"
    with IncidentStore(store_path) as store:
        core = AgentCore(store=store).start()
        core.submit([Declare(JOB, 0, 1), rank_finding(JOB, 0, 3), rank_summary(JOB, 0, 3)])
        assert core.flush(10)
        core.close()
    address = f"http://127.0.0.1:{port}"

    # implied by the daemon's environment: falls back to the store its config names, says both, prints no link
    env = _env(tmp_path, GRADLOC_AGENT_HTTP=f"127.0.0.1:{port}", GRADLOC_AGENT_DB=str(store_path))
    res = _cli("list", env=env)
    assert res.exit_code == 0, res.output
    assert f"no gradloc agent answers at {address}" in res.stderr and f"reading the store {store_path}" in res.stderr
    assert f"job {JOB}" in res.stdout or JOB in res.stdout
    incident_id = json.loads(_cli("list", "--json", env=env).stdout)[0]["incident_id"]
    show = _cli("show", incident_id[:12], env=env)
    assert show.exit_code == 0 and "page: none (no gradloc agent serves this store here" in show.stderr, show.output

    # named with --agent: no store read in its place; the message names the address and the local store
    res = _cli("list", "--agent", f"127.0.0.1:{port}", env=env)
    assert res.exit_code == 1
    assert f"no gradloc agent answers at {address}" in res.output and f"--db {store_path}" in res.output
    assert "not reading a store instead" in res.output

    # no store to fall back to
    res = _cli("list", env=_env(tmp_path, GRADLOC_AGENT_HTTP=f"127.0.0.1:{port}", GRADLOC_AGENT_DB="none"))
    assert res.exit_code == 1 and f"{address}" in res.output and "no incident store to read instead" in res.output

    # $GRADLOC_DB (no flag) is said; --db is not; both a store and a daemon named: a usage error
    res = _cli("list", env=_env(tmp_path, GRADLOC_DB=str(store_path)))
    assert res.exit_code == 0 and f"reading the store {store_path} ($GRADLOC_DB)" in res.stderr, res.output
    res = _cli("list", "--db", str(store_path), env=_env(tmp_path))
    assert res.exit_code == 0 and res.stderr == "", res.output
    res = _cli("list", "--db", str(store_path), "--agent", f"127.0.0.1:{port}", env=_env(tmp_path))
    assert res.exit_code == 2 and "give --db (a store) or --agent (a daemon), not both" in res.output
    res = _cli("list", "--agent", "nowhere", env=_env(tmp_path))
    assert res.exit_code == 2 and "expected HOST:PORT" in res.output


def test_each_closed_incident_is_one_info_line_at_its_level(caplog: pytest.LogCaptureFixture) -> None:
    """Item 6 without a daemon: the sink's line for a token-level and a sample-level incident."""
    from dataclasses import replace

    from gradloc.records.incidents import SampleShare

    core = AgentCore(exporters=[IncidentLog(lambda: "http://node-3:19917")]).start()
    token_level = rank_finding("a", 0, 5, share=0.6)
    loc = replace(token_level.localization, level="sample", spans=(),
                  samples=(SampleShare(2, 4, 0.5, share=0.94, tokens=12), SampleShare(0, 1, 0.3, share=0.02)))
    sample_level = replace(rank_finding("b", 0, 6), localization=loc)
    control = rank_finding("c", 0, 8, text="\x00\x1b[31m" + "z" * 60)  # client text: escaped once, cut short
    with caplog.at_level("INFO", logger="gradloc.agent.daemon"):
        for inc in (token_level, sample_level, control):
            core.submit([Declare(inc.job, 0, 1), inc, rank_summary(inc.job, 0, inc.step)])
        assert core.flush(10)
    core.close()
    lines = [r for r in caplog.records if r.getMessage().startswith("gradloc-agent: incident ")]
    assert [r.levelname for r in lines] == ["INFO", "INFO", "INFO"]
    ids = {i.job: i.incident_id for i in core.recent}
    first, second, third = (r.getMessage() for r in lines)
    assert "position 7 '\\x00\\x1b[31m" + "z" * 33 + "…' · 80.0% of ‖∇‖²" in third, third
    assert "\x1b" not in third and "\x00" not in third
    assert first.endswith(f"job a step 5 complete · located at the token level: micro-batch 1 · sample 0 (id s0) · "
                          f"position 7 ' bad' · 60.0% of ‖∇‖² · 1 probe(s) · http://node-3:19917/incidents/{ids['a']}"), first
    assert second.endswith(f"job b step 6 complete · located at the sample level: micro-batch 2 · sample 4 (12 loss "
                           f"tokens) (+1 more) · 60.0% of ‖∇‖² · 1 probe(s) · http://node-3:19917/incidents/{ids['b']}"), second
