"""The incident page's HTML (the browser test renders it for real; this checks what it contains)."""
from __future__ import annotations

import re
from dataclasses import replace
from html.parser import HTMLParser

from gradloc.agent.incident_page import incident_html, index_html
from gradloc.store.rows import IncidentRow
from tests.store.fixtures import BELL, make_incident


class _Spans(HTMLParser):
    """(class, alpha of the red background, title, text) of every token <span> (class tok or w)."""

    def __init__(self) -> None:
        super().__init__()
        self.out: list[list] = []
        self._open: list | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "span" and a.get("class") in ("tok", "w"):
            alpha = float(re.search(r"rgba\(231,76,60,([\d.]+)\)", a["style"]).group(1))
            self._open = [a["class"], alpha, a["title"], ""]

    def handle_data(self, data):
        if self._open is not None:
            self._open[3] += data

    def handle_endtag(self, tag):
        if tag == "span" and self._open is not None:
            self.out.append(self._open)
            self._open = None


def _tokens(page: str) -> list[list]:
    p = _Spans()
    p.feed(page)
    return p.out


def test_every_window_token_is_coloured_by_its_score_share_and_the_culprit_outlined():
    page = incident_html(make_incident())
    bell = _tokens(page)[:len(BELL.window_tokens)]  # rank 0's finding comes first
    assert [t[3] for t in bell] == list(BELL.window_tokens)
    assert [t[0] for t in bell] == ["w", "w", "w", "tok", "w", "w"]  # position 41 = window_start 38 + 3
    top = max(BELL.window_scores)
    for (_, alpha, title, _), score in zip(bell, BELL.window_scores):
        assert alpha == round(max(0.85 * score / top, 0.15 if score == top else 0.0), 2)
        assert f"score share {100 * score:.1f}%" in title
    assert "culprit, share of ‖∇‖² 90.0%" in bell[3][2]
    alphas = [t[1] for t in bell]
    assert alphas[4] > alphas[2] > alphas[1] == alphas[5] == 0.0  # 0.05 > 0.02 > 0: uncoloured


def test_a_span_without_a_window_colours_its_culprits_and_shows_plain_context():
    """Incidents from clients before the window fields (ZEBRA has none): culprits only."""
    page = incident_html(make_incident())
    zebra = _tokens(page)[len(BELL.window_tokens):]
    assert [t[0] for t in zebra] == ["tok", "tok"] and all(t[1] >= 0.15 for t in zebra)
    assert '<span class="ctx">…the quick brown</span>' in page


def test_window_text_is_escaped_and_an_empty_context_after_means_no_ellipsis():
    span = replace(BELL, window_tokens=("<b>x</b>", "\x1b[31m", "&", " bell", "\u202e", "z"), context_after="")
    inc = make_incident()
    f0 = inc.findings[0]
    f0 = replace(f0, localization=replace(f0.localization, spans=(span,)))
    page = incident_html(replace(inc, findings=(f0,)))
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page and "&amp;" in page
    assert "\x1b" not in page and "\u202e" not in page
    assert re.search(r'>z</span></div>', page)  # the sample ends in the window: no trailing "…"


def test_index_links_each_incident():
    inc = make_incident()
    page = index_html([IncidentRow.of(inc)])
    assert f'href="/incidents/{inc.incident_id}"' in page and inc.job in page


def test_a_rank_level_finding_names_its_rank_everywhere_a_user_reads_it():
    """A job-scope finding at the rank level (ranks.py): the CLI text, the one-line summary, the demo's
    JSON, the page and the store's JSON all name the rank, its micro-batches and its measured share."""
    import json

    from gradloc.agent.render import demo_json, incident_line, incident_text
    from gradloc.records import CulpritGroup
    from gradloc.store.incident_json import incident_from_json, incident_to_json

    inc = make_incident()
    f0 = inc.findings[0]
    group = CulpritGroup(share=0.96, rank=1, micro_batches=2, samples=8, tokens=128)
    loc = replace(f0.localization, level="rank", culprits=(), spans=(), groups=(group,), passes=3)
    f0 = replace(f0, localization=loc, scope="job")
    text = incident_text(f0, color=False)
    assert "at the rank level" in text and "(+3 extra pass(es))" in text
    assert "• rank 1 · every micro-batch (2) · 8 sample(s) · 128 loss token(s) · share 96.0%" in text
    assert "no culprit tokens found" not in text
    assert incident_line(f0).endswith(": rank 1 96.0%")
    row = demo_json([], [f0])["incidents"][0]
    assert (row["level"], row["groups"]) == ("rank", [{"share": 0.96, "micro_batch": None, "rank": 1,
                                                      "micro_batches": 2, "samples": 8, "tokens": 128}])
    json.dumps(row, allow_nan=False)
    page = incident_html(replace(inc, findings=(f0, *inc.findings[1:])))
    assert "<h3>rank 1 · every micro-batch (2) · 8 sample(s) · 128 loss token(s) · share 96.0%</h3>" in page
    assert incident_from_json(incident_to_json(f0)) == f0
