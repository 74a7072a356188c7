"""The incident page in a real browser: Debian's Chromium driven by Playwright (headless, offline).

An incident whose client-supplied strings (token text, context, sample id, job, note) are XSS
payloads is stored; this checkout's daemon serves ``/incidents`` and ``/incidents/<id>``, and
``gradloc-agent incidents show --html`` writes the same page to a file. In both, Chromium renders the
culprit tokens as text, no payload runs (``window.pwned`` stays undefined, no dialog opens), the
page requests nothing but itself, the culprit tokens stand out and the window's context tokens are
coloured by their score share (zero-score ones left uncoloured). A screenshot
is saved (docs/img/incident-page.png is one of these, committed).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gradloc.store.sqlite import IncidentStore
from tests.reliability.daemon import ROOT, serving
from tests.store.fixtures import make_incident

pytestmark = [pytest.mark.integration, pytest.mark.browser]
CHROMIUM = "/usr/lib/chromium/chromium"
XSS = ('<script>window.pwned=1</script><img src=x onerror="window.pwned=2">'
       '"><svg onload="window.pwned=3"></svg>\x1b]0;t\x07')


def _evil():
    inc = make_incident(time_unix=time.time())  # (the daemon's retention deletes the fixture's 2025 date)
    findings = []
    for f in inc.findings:
        loc = f.localization
        spans = tuple(replace(s, text=XSS, context_before=XSS, context_after=XSS, sample_id=XSS,
                              window_tokens=tuple(XSS + str(i) for i in range(len(s.window_tokens))))
                      for s in loc.spans)
        culprits = tuple(replace(c, text=XSS + str(i), sample_id=XSS) for i, c in enumerate(loc.culprits))
        findings.append(replace(f, job="job" + XSS, localization=replace(loc, spans=spans, culprits=culprits,
                                                                         note=XSS)))
    return replace(inc, job="job" + XSS, note=XSS, findings=tuple(findings))


def _browse(url: str, shot: Path) -> dict:
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs the test extra (playwright)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} missing: run scripts/setup.sh (Debian's chromium)", pytrace=False)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            requests, dialogs = [], []
            page.on("request", lambda r: requests.append(r.url))
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(url, timeout=30_000)
            page.screenshot(path=str(shot), full_page=True)
            styles = "els => els.map(e => [e.textContent, getComputedStyle(e).backgroundColor])"
            return {"pwned": page.evaluate("typeof window.pwned"), "requests": requests, "dialogs": dialogs,
                    "tokens": page.eval_on_selector_all(".tok", styles),
                    "window": page.eval_on_selector_all(".w", styles), "scripts": page.eval_on_selector_all("script", "els => els.length"),
                    "text": page.inner_text("body")}
        finally:
            browser.close()


def _check(got: dict, url: str) -> None:
    assert got["pwned"] == "undefined" and not got["dialogs"] and got["scripts"] == 0, got
    assert got["requests"] == [url], got["requests"]  # nothing external: no image, font, script
    texts = [t for t, _ in got["tokens"]]
    assert texts and all(t.startswith("<script>window.pwned=1</script>") for t in texts), texts
    assert "\\x1b]0;t\\x07" in got["text"]  # the escape sequence shown, not acted on
    # rank 0's span has a window: its context tokens are coloured by their score share (BELL's
    # fixture: 0.001, 0, 0.02, [culprit 0.81], 0.05, 0 -> alphas 0, 0, .02, .05, 0 against the top)
    alphas = [_alpha(bg) for _, bg in got["window"]]
    assert len(alphas) == 5 and alphas[3] > alphas[2] > 0 and alphas[1] == alphas[4] == 0, got["window"]
    assert all(t.startswith("<script>window.pwned=1</script>") for t, _ in got["window"])
    assert all(_alpha(bg) >= 0.15 for _, bg in got["tokens"]), got["tokens"]  # culprits stand out


def _alpha(css: str) -> float:
    """The alpha of a computed background colour: rgba(r, g, b, a), or rgb(...) = 1."""
    parts = css[css.index("(") + 1:-1].split(",")
    return float(parts[3]) if len(parts) == 4 else 1.0


def test_incident_page_served_and_written_is_inert_and_offline(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    inc = _evil()
    with IncidentStore(db) as store:
        store.put_incident(inc)
    with serving(tmp_path, "--ingest", "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", str(db)) as agent:
        url = f"http://{agent['http']}/incidents/{inc.incident_id}"
        served = _browse(url, tmp_path / "served.png")
        index = _browse(f"http://{agent['http']}/incidents", tmp_path / "index.png")
    _check(served, url)
    assert index["pwned"] == "undefined" and inc.incident_id[:12] in index["text"]
    out = tmp_path / "incident.html"
    res = subprocess.run([sys.executable, "-m", "gradloc.agent.cli", "incidents", "show", inc.incident_id[:8],
                          "--db", str(db), "--html", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    from_file = _browse(out.as_uri(), tmp_path / "file.png")
    _check(from_file, out.as_uri())
    assert (tmp_path / "file.png").stat().st_size > 10_000
