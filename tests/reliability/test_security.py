"""Exposing the agent safely: loopback by default, a token to go beyond it, TLS, IPv6 loopback, no
secret in any log. Real daemon processes (this checkout's code), a real AgentClient, urllib, and a
self-signed certificate made by the ``openssl`` binary for the test."""
from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gradloc.agent.config import AgentConfig
from gradloc.config import WatchConfig
from gradloc.errors import ConfigError
from gradloc.transport import AgentClient
from tests.builders import step_record
from tests.reliability.daemon import ROOT, serving

pytestmark = pytest.mark.integration
TOKEN = "s3cret-T0KEN-do-not-log"


def _get(url: str, token: str | None = None, ctx: ssl.SSLContext | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _send(address: str, **kw) -> dict[str, int]:
    client = AgentClient(address, job="sec", rank=1, world_size=4, timeout_s=5.0, **kw)
    client.on_step(step_record(3, job="sec", time_unix=time.time()))
    client.shutdown(timeout_s=20)
    return client.counters


def test_non_loopback_needs_a_token_or_insecure(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="auth token"):
        AgentConfig(ingest="0.0.0.0:0")
    with pytest.raises(ConfigError, match="--insecure"):
        AgentConfig(http="[::]:0")
    AgentConfig(ingest="0.0.0.0:0", http="0.0.0.0:0", insecure=True)
    AgentConfig(ingest="0.0.0.0:0", auth_token=TOKEN)
    AgentConfig(ingest="[::1]:0", http="localhost:0")  # loopback: fine without
    res = subprocess.run([sys.executable, "-m", "gradloc.agent.cli", "serve", "--ingest", "0.0.0.0:0", "--db", "none"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "auth token" in res.stderr
    assert TOKEN not in repr(AgentConfig(auth_token=TOKEN)) and TOKEN not in repr(WatchConfig(agent_token=TOKEN))


def test_token_on_grpc_and_http(tmp_path: Path) -> None:
    with serving(tmp_path, "--ingest", "127.0.0.1:0", "--http", "127.0.0.1:0",
                env={"GRADLOC_AGENT_AUTH_TOKEN": TOKEN}) as agent:
        refused = _send(agent["ingest"])
        wrong = _send(agent["ingest"], token="nope")
        ok = _send(agent["ingest"], token=TOKEN)
        base = f"http://{agent['http']}"
        codes = {p: (_get(base + p), _get(base + p, "nope"), _get(base + p, TOKEN))
                 for p in ("/metrics", "/api/incidents", "/healthz")}
        metrics = urllib.request.urlopen(urllib.request.Request(
            base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}), timeout=10).read().decode()
    assert refused["rejected"] == 1 and refused["sent_steps"] == 0
    assert wrong["rejected"] == 1 and ok["sent_steps"] == 1 and ok["rejected"] == 0
    assert codes["/metrics"] == (401, 401, 200) and codes["/api/incidents"] == (401, 401, 200)
    assert codes["/healthz"] == (200, 200, 200)
    # two refused clients, two calls each: the hello (sent at construction, no records) and the step's batch
    assert 'gradloc_agent_rejected_total{reason="unauthenticated"} 4.0' in metrics
    assert TOKEN not in Path(agent["log"]).read_text()  # debug logging, every request logged: no token


def test_metrics_open_for_prometheus(tmp_path: Path) -> None:
    with serving(tmp_path, "--ingest", "127.0.0.1:0", "--http", "127.0.0.1:0", "--metrics-open",
                env={"GRADLOC_AGENT_AUTH_TOKEN": TOKEN}) as agent:
        base = f"http://{agent['http']}"
        assert _get(base + "/metrics") == 200 and _get(base + "/api/incidents") == 401


def test_tls_on_grpc_and_http_with_a_self_signed_certificate(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1"],
                   check=True, capture_output=True, timeout=60)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with serving(tmp_path, "--ingest", "127.0.0.1:0", "--http", "127.0.0.1:0", "--tls-cert", str(cert),
                "--tls-key", str(key), "--auth-token-file", str(token_file)) as agent:
        ok = _send(agent["ingest"], token=TOKEN, tls_ca=str(cert))
        plain = _send(agent["ingest"], token=TOKEN)  # no TLS against a TLS port: not delivered, never hangs
        ctx = ssl.create_default_context(cafile=str(cert))
        https = _get(f"https://{agent['http']}/api/incidents", TOKEN, ctx)
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://{agent['http']}/healthz", timeout=10).read()
        assert _get(f"https://{agent['http']}/healthz", ctx=ctx) == 200  # still serving after the bad client
    assert ok["sent_steps"] == 1 and plain["sent_steps"] == 0 and https == 200
    assert TOKEN not in Path(agent["log"]).read_text()


def test_ipv6_loopback(tmp_path: Path) -> None:
    with serving(tmp_path, "--ingest", "[::1]:0", "--http", "[::1]:0") as agent:
        port = agent["ingest"].rsplit(":", 1)[1]
        http_port = agent["http"].rsplit(":", 1)[1]
        sent = _send(f"[::1]:{port}")
        assert _get(f"http://[::1]:{http_port}/healthz") == 200
    assert sent["sent_steps"] == 1
