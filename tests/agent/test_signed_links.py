"""Signed page links (gradloc/agent/links.py): with an auth token, a signed link opens one incident's page
(or its trace redirect) without the Authorization header, and nothing else; a tampered, expired or
other-page link gets a 401/403 page that never contains the incident. Real HTTP server, real core."""
from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gradloc.agent import links  # noqa: E402
from gradloc.agent.cli import main  # noqa: E402
from gradloc.agent.config import AgentConfig, load_config  # noqa: E402
from gradloc.agent.core import AgentCore, Declare  # noqa: E402
from gradloc.agent.http import AgentHttpServer  # noqa: E402
from gradloc.agent.links import INCIDENT, TRACE, LinkSigner  # noqa: E402
from gradloc.agent.security import Security  # noqa: E402
from gradloc.errors import ConfigError  # noqa: E402
from gradloc.store import IncidentStore  # noqa: E402
from tests.builders import INCIDENT_ID, make_incident, rank_finding, rank_summary  # noqa: E402  # noqa: E402

TOKEN = "link-T0KEN-never-shown"
TTL = 600.0
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
J, K = "job-alpha-secret", "job-beta-secret"  # an incident page shows its job: a refused page never does


def fetch(url: str, token: str | None = None, accept: str | None = None) -> tuple[int, str, str]:
    """(status, body, final URL after redirects) with an optional bearer token."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if accept:
        headers["Accept"] = accept
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
            return resp.status, resp.read().decode(), resp.url
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), url


def _serve(security: Security | None):
    core = AgentCore().start()
    core.submit([Declare(J, 0, 1), rank_finding(J, 0, 3), rank_summary(J, 0, 3),
                 Declare(K, 0, 1), rank_finding(K, 0, 4), rank_summary(K, 0, 4)])
    assert core.flush(10)
    http = AgentHttpServer(core, "127.0.0.1:0", security).start()
    return core, http, "http://%s:%d" % http.address


@pytest.fixture
def served():
    """A core with two incidents (jobs J and K) behind a token; yields (base URL, {job: api row})."""
    core, http, base = _serve(Security(TOKEN, link_ttl_s=TTL))
    code, body, _ = fetch(base + "/api/incidents", TOKEN)
    assert code == 200
    rows = {r["job"]: r for r in json.loads(body)}
    assert set(rows) == {J, K}
    yield base, rows
    http.stop()
    core.close()


def _refused(code: int, body: str, *secrets: str) -> None:
    assert code in (401, 403), (code, body[:300])
    assert "Traceback" not in body
    for secret in secrets:
        assert secret not in body, f"{secret!r} leaked into a refused response"


# -- the signer --------------------------------------------------------------------------------------
def test_a_signature_opens_only_its_own_page_until_it_expires() -> None:
    signer = LinkSigner(TOKEN, TTL)
    sig = signer.mint(INCIDENT, "abc123", now=1_000.0)
    assert re.fullmatch(r"1600\.[A-Za-z0-9_-]{22}", sig)
    assert signer.check(INCIDENT, "abc123", sig, now=1_500.0) is None
    assert signer.check(INCIDENT, "abc123", sig, now=1_601.0) == "expired"
    assert signer.check(INCIDENT, "abc124", sig, now=1_500.0) == "invalid"  # another incident
    assert signer.check(TRACE, "abc123", sig, now=1_500.0) == "invalid"  # another kind of page
    assert LinkSigner("other-token", TTL).check(INCIDENT, "abc123", sig, now=1_500.0) == "invalid"
    mac = sig.split(".")[1]
    flipped = mac[:-1] + ("A" if mac[-1] != "A" else "B")
    assert signer.check(INCIDENT, "abc123", f"1600.{flipped}", now=1_500.0) == "invalid"
    assert signer.check(INCIDENT, "abc123", f"99999.{mac}", now=1_500.0) == "invalid"  # a later expiry
    for bad in ("", "1600", "1600.", "x.y", "1600." + "a" * 21, "1600." + "é" * 22, None):
        assert signer.check(INCIDENT, "abc123", bad, now=1_500.0) == "malformed"
    assert TOKEN not in repr(signer) and "key" not in repr(signer)


def test_exemplar_signatures_are_stable_and_fit_the_openmetrics_limit() -> None:
    signer = LinkSigner(TOKEN, TTL)
    trace = "0123456789abcdef" * 2
    sig = signer.for_exemplar(trace, 1_700_000_000.25)
    assert sig == signer.for_exemplar(trace, 1_700_000_000.25)  # the same at every scrape
    assert signer.check(TRACE, trace, sig, now=1_700_000_000.0 + TTL) is None
    assert signer.check(TRACE, trace, sig, now=1_700_000_002.0 + TTL) == "expired"
    assert len("trace_id") + len(trace) + len("sig") + len(sig) <= 128
    assert signer.for_exemplar(trace, float("nan")) is None and signer.for_exemplar("bad id!", 1.0) is None


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("nan"), 31 * 86_400.0])
def test_the_ttl_is_validated(ttl: float) -> None:
    with pytest.raises(ConfigError, match="link_ttl_s"):
        AgentConfig(link_ttl_s=ttl)
    with pytest.raises(ValueError, match="link_ttl_s"):
        LinkSigner(TOKEN, ttl)


def test_the_ttl_comes_from_the_config_sources() -> None:
    assert AgentConfig().link_ttl_s == links.DEFAULT_TTL_S == 86_400.0
    cfg = load_config(None, {"GRADLOC_AGENT_LINK_TTL_S": "900", "GRADLOC_AGENT_AUTH_TOKEN": TOKEN})
    assert cfg.link_ttl_s == 900.0 and cfg.security().link_ttl_s == 900.0
    res = CliRunner().invoke(main, ["serve", "--db", "none", "--link-ttl-s", "0"])
    assert res.exit_code == 2 and "link_ttl_s" in res.output


def test_signatures_are_redacted_from_access_logs() -> None:
    line = links.redact('"GET /incidents/abc?sig=1600.AAAAAAAAAAAAAAAAAAAAAA&x=1 HTTP/1.1" 200 -')
    assert "AAAAAAAA" not in line and "/incidents/abc?sig=" in line and "&x=1" in line


# -- the server --------------------------------------------------------------------------------------
def test_a_signed_link_opens_the_page_without_the_header(served) -> None:
    base, rows = served
    row = rows[J]
    assert row["link"].startswith(f"{base}/incidents/{row['incident_id']}?sig=")
    code, body, _ = fetch(row["link"])  # no Authorization header
    assert code == 200 and row["incident_id"][:12] in body and J in body
    code, body, _ = fetch(f"{base}/incidents/{row['incident_id']}")  # the same page without the link
    _refused(code, body, J, row["trace_id"])
    assert code == 401 and "signed link" in body


def test_the_index_lists_a_signed_link_per_incident_that_opens_its_page(served) -> None:
    base, rows = served
    code, body, _ = fetch(base + "/incidents", TOKEN)  # the index itself needs the token
    assert code == 200 and "share (no token needed)" in body
    hrefs = [h.replace("&amp;", "&") for h in re.findall(r'href="([^"]+\?sig=[^"]+)"', body)]
    assert len(hrefs) == len(rows) == 2
    for job, row in rows.items():
        href = next(h for h in hrefs if f"/incidents/{row['incident_id']}?" in h)
        code, page, _ = fetch(href)  # no Authorization header
        assert code == 200 and job in page
    _refused(*fetch(base + "/incidents")[:2], J, K)  # the index stays closed without the token


def test_a_signed_link_opens_nothing_else(served) -> None:
    base, rows = served
    j, k = rows[J], rows[K]
    sig = j["link"].split("sig=")[1]
    for path in ("/api/incidents", f"/api/incidents/{j['incident_id']}", "/metrics", "/incidents",
                 "/api/outliers", f"/incidents/{k['incident_id']}"):
        for query in ("", f"?sig={sig}"):
            code, body, _ = fetch(base + path + query)
            _refused(code, body, J, K, j["trace_id"], k["trace_id"])
    code, body, _ = fetch(f"{base}/incidents/{k['incident_id']}?sig={sig}")  # j's link on k's page
    assert code == 403 and "not valid for this page" in body
    code, body, _ = fetch(f"{base}/incidents/{j['incident_id'][:12]}?sig={sig}")  # a prefix: another page
    _refused(code, body, J)
    assert fetch(base + "/healthz")[0] == 200  # open, as before


def test_tampered_and_expired_links_are_refused(served) -> None:
    base, rows = served
    inc = rows[J]["incident_id"]
    expires, mac = rows[J]["link"].split("sig=")[1].split(".")
    stale = LinkSigner(TOKEN, TTL).mint(INCIDENT, inc, now=time.time() - 2 * TTL)  # the server's key, expired
    cases = {f"{int(expires) + 3600}.{mac}": "not valid",  # a later expiry, the same mac
             f"{expires}.{mac[::-1]}": "not valid", stale: "expired",
             LinkSigner("another-token", TTL).mint(INCIDENT, inc): "not valid", "garbage": "not well-formed"}
    for sig, why in cases.items():
        code, body, _ = fetch(f"{base}/incidents/{inc}?sig={sig}")
        _refused(code, body, J, rows[J]["trace_id"], inc[:12])
        assert code == 403 and why in body, (sig, body)
    code, body, _ = fetch(f"{base}/incidents/{inc}?sig=")  # an exemplar without a sig label
    _refused(code, body, J)


def test_a_signed_trace_link_redirects_to_a_signed_page(served) -> None:
    """What a Grafana exemplar link opens: /incidents/trace/<trace id>?sig=<the exemplar's sig>."""
    base, rows = served
    j, k = rows[J], rows[K]
    signer = LinkSigner(TOKEN, TTL)
    sig = signer.for_exemplar(j["trace_id"], time.time())
    code, body, final = fetch(f"{base}/incidents/trace/{j['trace_id']}?sig={sig}")
    assert code == 200 and final.startswith(f"{base}/incidents/{j['incident_id']}?sig={sig.split('.')[0]}.")
    assert j["incident_id"][:12] in body and J in body
    code, body, _ = fetch(f"{base}/incidents/trace/{k['trace_id']}?sig={sig}")  # j's sig on k's trace
    _refused(code, body, K, k["incident_id"][:12])
    page_sig = signer.mint(INCIDENT, j["incident_id"])  # a page's sig is not a trace's
    code, body, _ = fetch(f"{base}/incidents/trace/{j['trace_id']}?sig={page_sig}")
    _refused(code, body, J, j["incident_id"][:12])


def _exemplars(text: str) -> list[dict[str, str]]:
    return [dict(re.findall(r'(\w+)="([^"]*)"', m)) for m in re.findall(r" # \{([^}]*)\}", text)]


def test_exemplars_carry_the_signature_only_for_a_scrape_with_the_token(served) -> None:
    base, rows = served
    code, text, _ = fetch(base + "/metrics", TOKEN, OPENMETRICS)
    exemplars = _exemplars(text)
    assert code == 200 and exemplars and all(set(e) == {"trace_id", "sig"} for e in exemplars), exemplars
    by_trace = {r["trace_id"]: r for r in rows.values()}
    for ex in exemplars:  # the link Grafana builds from the exemplar opens that incident's page
        code, body, _ = fetch(f"{base}/incidents/trace/{ex['trace_id']}?sig={ex['sig']}")
        assert code == 200 and by_trace[ex["trace_id"]]["incident_id"][:12] in body
    assert _exemplars(fetch(base + "/metrics", TOKEN, OPENMETRICS)[1]) == exemplars  # stable across scrapes


def test_an_open_metrics_endpoint_never_hands_out_links() -> None:
    core, http, base = _serve(Security(TOKEN, metrics_open=True, link_ttl_s=TTL))
    try:
        code, text, _ = fetch(base + "/metrics", accept=OPENMETRICS)
        open_exemplars = _exemplars(text)
        assert code == 200 and open_exemplars and all(set(e) == {"trace_id"} for e in open_exemplars)
        assert all("sig" in e for e in _exemplars(fetch(base + "/metrics", TOKEN, OPENMETRICS)[1]))
        assert fetch(base + "/api/incidents")[0] == 401
    finally:
        http.stop()
        core.close()


def test_without_a_token_links_are_plain_and_pages_open() -> None:
    core, http, base = _serve(None)
    try:
        rows = json.loads(fetch(base + "/api/incidents")[1])
        assert rows and all(r["link"] == f"{base}/incidents/{r['incident_id']}" for r in rows)
        code, body, _ = fetch(rows[0]["link"] + "?sig=ignored")
        assert code == 200 and rows[0]["incident_id"][:12] in body
        assert "sig=" not in fetch(base + "/metrics", accept=OPENMETRICS)[1]
        assert "share (no token needed)" not in fetch(base + "/incidents")[1]  # nothing to sign without a token
    finally:
        http.stop()
        core.close()


# -- incidents show ------------------------------------------------------------------------------
def test_incidents_show_prints_a_link_that_opens_the_page(tmp_path: Path) -> None:
    db = tmp_path / "i.db"
    with IncidentStore(db) as store:
        store.put_incident(make_incident())
    env = {"GRADLOC_AGENT_AUTH_TOKEN": TOKEN, "GRADLOC_AGENT_HTTP": "127.0.0.1:9917",
           "GRADLOC_AGENT_LINK_TTL_S": str(TTL), "GRADLOC_AGENT_CONFIG": None}
    res = CliRunner().invoke(main, ["incidents", "show", INCIDENT_ID[:8], "--db", str(db), "--json"], env=env)
    assert res.exit_code == 0, res.output
    json.loads(res.stdout)  # the link goes to stderr: stdout stays JSON
    (link,) = re.findall(r"page: (\S+)", res.stderr)
    prefix = f"http://127.0.0.1:9917/incidents/{INCIDENT_ID}?sig="
    assert link.startswith(prefix)
    sig = link[len(prefix):]
    assert LinkSigner(TOKEN, TTL).check(INCIDENT, INCIDENT_ID, sig) is None
    assert time.time() + TTL - 5 <= links.expiry(sig) <= time.time() + TTL + 5
    plain = CliRunner().invoke(main, ["incidents", "show", INCIDENT_ID[:8], "--db", str(db)],
                               env={**env, "GRADLOC_AGENT_AUTH_TOKEN": None})
    assert plain.exit_code == 0 and f"page: http://127.0.0.1:9917/incidents/{INCIDENT_ID}\n" in plain.stderr


def test_links_use_https_when_the_daemon_serves_tls(tmp_path: Path) -> None:
    import ssl
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    core, http, _ = _serve(Security(TOKEN, str(cert), str(key), link_ttl_s=TTL))
    ctx = ssl.create_default_context(cafile=str(cert))
    base = "https://127.0.0.1:%d" % http.address[1]
    try:
        req = urllib.request.Request(base + "/api/incidents", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            rows = json.loads(resp.read())
        assert rows and all(r["link"].startswith(f"{base}/incidents/{r['incident_id']}?sig=") for r in rows)
        with urllib.request.urlopen(rows[0]["link"], timeout=10, context=ctx) as resp:  # no header
            assert resp.status == 200 and rows[0]["incident_id"][:12] in resp.read().decode()
    finally:
        http.stop()
        core.close()
    assert links.origin(None, ("0.0.0.0", 9917), True).startswith("https://")
    assert links.origin("node-17:9917", ("0.0.0.0", 9917), False) == "http://node-17:9917"
    assert links.origin("evil\r\nX: y", ("10.0.0.5", 9917), False) == "http://10.0.0.5:9917"  # not a host: ignored
