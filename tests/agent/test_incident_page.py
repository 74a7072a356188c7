"""The incident page's HTML (the browser test renders it for real; this checks what it contains)."""
from __future__ import annotations

import math
import re
from dataclasses import replace
from html.parser import HTMLParser

from gradloc.agent.incident_page import incident_html, index_html
from gradloc.agent.store_context import StoreContext
from gradloc.store.rows import IncidentRow
from tests.builders import BELL, make_incident


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
    assert "located at the rank level: rank 1 (all 2 micro-batches, 8 samples, 128 loss tokens)" in incident_line(f0)
    row = demo_json([], [f0])["incidents"][0]
    assert (row["level"], row["groups"]) == ("rank", [{"share": 0.96, "micro_batch": None, "rank": 1,
                                                      "micro_batches": 2, "samples": 8, "tokens": 128}])
    json.dumps(row, allow_nan=False)
    page = incident_html(replace(inc, findings=(f0, *inc.findings[1:])))
    assert "<h3>rank 1 · every micro-batch (2) · 8 sample(s) · 128 loss token(s) · share 96.0%</h3>" in page
    assert incident_from_json(incident_to_json(f0)) == f0


# -- the charts, the layer and sample tables, the follow-up steps --------------------------------------

class _Tags(HTMLParser):
    """(tag, attributes) of every start tag, and the text of every <title> inside an <svg>."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.titles: list[str] = []
        self._title = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._title = tag == "title"

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        if self._title:
            self.titles.append(data)

    def handle_endtag(self, tag):
        self._title = False


def _tags(page: str) -> _Tags:
    p = _Tags()
    p.feed(page)
    return p


def _of(p: _Tags, tag: str, cls: str) -> list[dict]:
    return [a for t, a in p.tags if t == tag and cls in (a.get("class") or "").split()]


def _history(first: int = 1181, last: int = 1200, nan_at: int | None = 1190, rank: int = 0):
    """Steps first..last of ``rank``: norm 0.8 (3.5 at 1200), loss 2.0 (2.9 at 1200), band 0.8 → 1.0."""
    from gradloc.reports import StepPoint

    return tuple(StepPoint(rank=rank, step=s, global_norm=math.nan if s == nan_at else (3.5 if s == 1200 else 0.8),
                           loss=2.9 if s == 1200 else 2.0, norm_mean=0.8, norm_threshold=1.0)
                 for s in range(first, last + 1))


def _rows(steps, rank: int = 0, norm: float = 0.9):
    from gradloc.store.rows import StepRow

    return [StepRow("llm-7b", rank, s, 0.0, 1.6 if s == 1203 else norm, 2.1, None, None, 0, False) for s in steps]


def test_the_norm_chart_has_a_point_per_finite_step_the_band_and_the_incident_marked():
    inc = replace(make_incident(), history=_history())
    p = _tags(incident_html(inc, StoreContext(steps=tuple(_rows(range(1201, 1206))))))
    assert len(_of(p, "svg", "chart")) == 2  # the norm and the loss
    points = _of(p, "circle", "pt")
    assert len(points) == 19 + 5  # 20 history steps, one NaN; 5 follow-up steps from the store
    hit = _of(p, "circle", "hit")
    assert len(hit) == 1 and float(hit[0]["r"]) > float(points[0]["r"])
    marker = _of(p, "line", "incident")
    assert len(marker) == 2 and {m["x1"] for m in marker} == {hit[0]["cx"]}  # both charts, at the incident's x
    nonfinite = _of(p, "polygon", "nonfinite")
    assert len(nonfinite) == 1 and "step 1190: ‖∇‖ —" in p.titles
    band = _of(p, "polygon", "band")  # every history step carries its band (the NaN one too); the store's rows none
    assert len(band) == 1 and len(band[0]["points"].split()) == 2 * 20  # the line over 20 steps, then the mean back
    xs = sorted(float(a["cx"]) for a in points)
    assert xs == sorted(set(xs))  # one x per step
    assert len(_of(p, "line", "ref")) == 1  # the incident's line drawn over the follow-up steps
    assert len(_of(p, "circle", "lpt")) == 20 + 5  # every step has a loss (the NaN norm step too)
    above = [a for a in points if a["fill"] == "#c0392b" and "hit" not in a["class"]]
    assert len(above) == 1 and "step 1203: ‖∇‖ 1.6 (above the line)" in p.titles


def test_chart_points_merge_the_history_with_the_store_rows_of_the_same_rank():
    from gradloc.agent.page_chart import STEPS_AROUND, chart_points

    inc = replace(make_incident(), history=_history(nan_at=None))
    rows = _rows([1150, 1199, 1200, 1201, 1200 + STEPS_AROUND, 1201 + STEPS_AROUND]) + _rows([1202], rank=1)
    pts = chart_points(inc, rows)
    assert [p.step for p in pts] == [1150, *range(1181, 1202), 1200 + STEPS_AROUND]  # rank 1's and the far step left out
    at = {p.step: p for p in pts}
    assert at[1200].global_norm == 3.5 and at[1200].norm_threshold == 1.0  # the history wins over the store's row
    assert at[1201].global_norm == 0.9 and at[1201].norm_threshold is None  # the store keeps no band


def test_page_steps_asks_the_store_for_the_chart_ranks_window_and_survives_a_failing_store():
    from gradloc.agent.page_chart import STEPS_AROUND, page_steps

    asked = []

    class Store:
        def step_range(self, job, rank, first, last):
            asked.append((job, rank, first, last))
            return _rows([first, last])

    class Broken:
        def step_range(self, *args):
            raise RuntimeError("database is locked")

    inc = replace(make_incident(), history=_history(rank=1))
    assert [r.step for r in page_steps(Store(), inc)] == [1200 - STEPS_AROUND, 1200 + STEPS_AROUND]
    assert asked == [("llm-7b", 1, 1200 - STEPS_AROUND, 1200 + STEPS_AROUND)]
    assert page_steps(Broken(), inc) == [] and page_steps(None, inc) == []


def test_the_store_returns_a_step_range_of_one_rank(tmp_path):
    from gradloc.agent.page_chart import STEPS_AROUND, page_steps
    from gradloc.store.sqlite import IncidentStore
    from tests.builders import step_summary

    with IncidentStore(tmp_path / "s.db") as store:
        store.put_steps([step_summary("llm-7b", r, s, 0.0) for s in range(1100, 1300, 7) for r in (0, 1)])
        rows = page_steps(store, make_incident())  # no history: the lowest rank with a finding, 0
    window = [s for s in range(1100, 1300, 7) if 1200 - STEPS_AROUND <= s <= 1200 + STEPS_AROUND]
    assert [r.step for r in rows] == window and {r.rank for r in rows} == {0}


def test_bad_input_renders_dashes_never_raises():
    from gradloc.reports import StepPoint
    from tests.builders import nonfinite_incident

    old = incident_html(make_incident())  # stored before the history field: no chart, said so
    assert "<svg" not in old and "no step history" in old
    nan = (StepPoint(rank=0, step=1199, global_norm=math.nan), StepPoint(rank=0, step=1200, global_norm=math.inf))
    page = incident_html(replace(make_incident(), history=nan))
    p = _tags(page)
    assert not _of(p, "circle", "pt") and "no step history to chart: —" in page and "no loss in the step history: —" in page
    no_band = tuple(replace(x, norm_mean=None, norm_threshold=None) for x in _history())
    p = _tags(incident_html(replace(make_incident(), history=no_band)))
    assert not _of(p, "polygon", "band") and len(_of(p, "circle", "pt")) == 19
    one = _history(first=1200)
    p = _tags(incident_html(replace(make_incident(), history=one)))
    assert len(_of(p, "circle", "pt")) == 1 and len(_of(p, "polygon", "band")) == 1
    inf = incident_html(replace(nonfinite_incident(), history=nan))
    assert "‖∇‖ <b>+inf</b>" in inf and "nan" not in inf.lower().replace("nonfinite", "")
    negative = tuple(replace(x, global_norm=-1.0 if x.step == 1185 else x.global_norm) for x in _history(nan_at=None))
    assert len(_of(_tags(incident_html(replace(make_incident(), history=negative))), "circle", "pt")) == 20  # linear axis


def test_client_strings_are_escaped_in_tables_and_charts():
    from gradloc.records import LayerStats

    evil = "<script>x</script>\x1b]0;t\x07"
    inc = make_incident()
    f0 = inc.findings[0]
    layer = LayerStats(layer=evil, grad_norm=2.0, grad_max_abs=1.0, nonfinite=0, param_norm=1.0, numel=1, z=9.0)
    samples = tuple(replace(x, sample_id=evil) for x in f0.localization.samples)
    f0 = replace(f0, top_layers=(layer,), spike=replace(f0.spike, layers=(evil,)),
                 localization=replace(f0.localization, samples=samples))
    page = incident_html(replace(inc, findings=(f0,), top_layers=(evil,), history=_history()))
    assert "<script>" not in page and "\x1b" not in page and "\x07" not in page
    assert page.count("&lt;script&gt;x&lt;/script&gt;\\x1b]0;t\\x07") >= 4  # summary, layer table, samples (2)


def test_the_layer_table_lists_every_layer_by_share_with_its_z_score_and_flag():
    from gradloc.records import LayerStats

    inc = make_incident()
    f0 = inc.findings[0]
    norms = {f"blocks.{i}": 0.1 * (i + 1) for i in range(12)}  # blocks.11 the largest
    layers = tuple(LayerStats(layer=name, grad_norm=g, grad_max_abs=g, nonfinite=0, param_norm=1.0, numel=10,
                              z=None if name == "blocks.3" else 10.0 * g) for name, g in norms.items())
    f0 = replace(f0, top_layers=layers, spike=replace(f0.spike, layers=("blocks.0", "blocks.7")))
    page = incident_html(replace(inc, findings=(f0,)))
    table = page[page.index("Layers: 12 listed, 2 flagged"):]
    table = table[:table.index("</table>")]
    names = re.findall(r"<tr(?: class=\"flagged\")?><td>(blocks\.\d+)</td>", table)
    assert names == [f"blocks.{i}" for i in range(11, -1, -1)]  # every layer, the largest share first
    assert re.findall(r'<tr class="flagged"><td>(blocks\.\d+)</td>', table) == ["blocks.7", "blocks.0"]
    share = (1.2 / f0.spike.global_norm) ** 2
    assert f"<td>blocks.11</td><td><span class=\"bar\" style=\"width:{round(200 * share)}px\"></span> " \
           f"{100 * share:.1f}%</td><td>1.2</td><td>12</td>" in table
    assert "<td>blocks.3</td>" in table and re.search(r"<td>blocks\.3</td>.*?<td>0\.4</td><td>—</td>", table)
    assert "z-scores: —" not in page
    old = incident_html(make_incident())  # the fixture's client sent two layers without z
    assert "z-scores: — (this client sent its five largest layers, without z-scores)" in old


def test_samples_show_their_attributed_and_measured_shares():
    inc = make_incident()
    f0 = inc.findings[0]
    samples = (replace(f0.localization.samples[0], share=0.42), f0.localization.samples[1])
    f0 = replace(f0, localization=replace(f0.localization, samples=samples))
    page = incident_html(replace(inc, findings=(f0,)))
    assert "<td>3</td><td>1</td><td>s1200-3-1</td><td>56</td><td>80.0%</td><td>42.0%</td>" in page
    assert "<td>0</td><td>0</td><td>—</td><td>56</td><td>3.0%</td><td>—</td>" in page  # no probe spent: —


def test_ranks_and_numbers_read_as_words_not_python():
    page = incident_html(make_incident())
    assert "3 expected (0–2) · 2 reported (0–1) · 1 missing (2)" in page and "[0" not in page and "()" not in page
    assert "(4.38× the healthy mean)" in page  # 3.5 against 0.8
    assert ("blocks.1.proj 0.0% ▲, head 0.0% (% of ‖∇‖², largest first; 1 layer(s) flagged ▲: z above the layer "
            "z threshold)") in page


def test_a_wide_window_is_drawn_whole():
    """±200 tokens around the culprit (WINDOW_TOKENS): every one drawn, the culprit outlined in the middle."""
    from gradloc.localizer.spans import WINDOW_TOKENS

    n = 2 * WINDOW_TOKENS + 1
    span = replace(BELL, window_start=41 - WINDOW_TOKENS, window_tokens=tuple(f" t{i}" for i in range(n)),
                   window_scores=tuple(0.81 if i == WINDOW_TOKENS else 0.001 for i in range(n)))
    inc = make_incident()
    f0 = inc.findings[0]
    f0 = replace(f0, localization=replace(f0.localization, spans=(span,)))
    toks = _tokens(incident_html(replace(inc, findings=(f0,))))[:n]
    assert len(toks) == n and [t[0] for t in toks].index("tok") == WINDOW_TOKENS
    assert f"{n} tokens of the sample from position {41 - WINDOW_TOKENS}" in incident_html(replace(inc, findings=(f0,)))


def test_the_correlated_incident_carries_the_steps_the_agent_held_with_their_band_through_the_store_json():
    """The history is built agent-side from step records every client already sends (no wire change)."""
    from gradloc.agent.correlator import Correlator, CorrelatorConfig
    from gradloc.store.incident_json import correlated_from_dict, correlated_to_dict
    from tests.builders import rank_finding, rank_summary

    out = []
    c = Correlator(out.append, CorrelatorConfig(history_steps=8), lambda: "0" * 32, lambda: 0.0)
    c.declare("j", 0, 2)
    c.declare("j", 1, 2)
    for step in range(1, 20):
        for rank in (0, 1):
            s = rank_summary("j", rank, step)
            c.on_step(replace(s, norm_mean=0.5 * step, norm_threshold=None if step == 12 else step + 0.0))
    c.on_incident(rank_finding("j", 1, 19))
    assert len(out) == 1
    h = out[0].history
    assert [p.step for p in h] == list(range(12, 20)) and {p.rank for p in h} == {1}  # the finding's rank, ring of 8
    assert (h[-1].global_norm, h[-1].loss, h[-1].norm_mean, h[-1].norm_threshold) == (3.0, 3.0, 9.5, 19.0)
    assert h[0].norm_threshold is None
    assert correlated_from_dict(correlated_to_dict(out[0])) == out[0]
    old = correlated_to_dict(out[0])
    del old["history"]  # stored by a gradloc before the field: decodes, no history
    assert correlated_from_dict(old).history == ()


def test_layer_z_scores_cross_the_wire_and_a_nan_one_arrives_as_unknown():
    from gradloc.records import LayerStats
    from gradloc.transport.codec_incidents import encode_incident
    from gradloc.transport.decode_incidents import decode_incident

    f0 = make_incident().findings[0]
    layers = (LayerStats(layer="a", grad_norm=2.0, grad_max_abs=1.0, nonfinite=0, param_norm=1.0, numel=4, z=12.5),
              LayerStats(layer="b", grad_norm=1.0, grad_max_abs=1.0, nonfinite=0, param_norm=1.0, numel=4),
              LayerStats(layer="c", grad_norm=0.5, grad_max_abs=1.0, nonfinite=0, param_norm=1.0, numel=4, z=math.nan))
    got = decode_incident(encode_incident(replace(f0, top_layers=layers)), 4, "$")
    assert [s.z for s in got.top_layers] == [12.5, None, None]
    assert not encode_incident(replace(f0, top_layers=layers[1:2])).top_layers[0].HasField("z")  # old readers: absent


def test_a_new_cause_inside_an_episode_says_so_on_its_page():
    inc = make_incident()
    f0 = inc.findings[0]
    detail = "new cause inside the episode of step 29: 12 new culprit sample(s) <x>"
    page = incident_html(replace(inc, findings=(replace(f0, spike=replace(f0.spike, detail=detail)),)))
    assert "new cause inside the episode of step 29" in page and "&lt;x&gt;" in page
    assert "new cause" not in incident_html(replace(inc, findings=(f0,)))


def test_a_follow_up_links_its_episode_s_incident():
    inc = make_incident()
    f0 = inc.findings[0]
    follow = replace(inc, findings=(replace(f0, spike=replace(f0.spike, follows=1190, detail="new cause <y>")),))
    page = incident_html(follow, StoreContext(opener_id="ab" * 16))
    assert f'<a href="/incidents/{"ab" * 16}">the incident of step 1190</a>' in page and "&lt;y&gt;" in page
    assert "the incident of step 1190 (not in this store)" in incident_html(follow)  # opener unknown: no link
    assert 'class="follows"' not in incident_html(inc, StoreContext(opener_id="ab" * 16))  # not a follow-up: nothing


# -- issue 33: the words, and a page that leads with the answer --------------------------------------

def test_a_one_process_run_reads_single_process_on_the_page_and_in_the_cli():
    from gradloc.agent.render_correlated import correlated_text, ranks_summary
    from tests.builders import flooded_incident

    inc = flooded_incident(tokens=40, culprits=4)
    assert ranks_summary(inc) == "single process (rank 0)"
    assert "<td>ranks</td><td>single process (rank 0)</td>" in incident_html(inc)
    assert "  ranks: single process (rank 0)" in correlated_text(inc, color=False)
    assert "expected 0 ·" not in correlated_text(inc, color=False)
    assert ranks_summary(replace(inc, ranks_expected=())) == "world size unknown · 1 reported (0) · none missing"


def test_the_header_note_is_the_localizations_note_when_the_incident_has_none():
    from gradloc.agent.render_correlated import correlated_text, header_note
    from tests.builders import flooded_incident

    inc = flooded_incident(tokens=40, culprits=4)
    note = inc.findings[0].localization.note
    assert inc.note == "" and note and header_note(inc) == note
    assert f"<td>note</td><td>{note.replace(chr(39), '&#x27;')}</td>" in incident_html(inc)
    assert f"  note: {note}" in correlated_text(inc, color=False)
    two = make_incident()  # the correlator's note first, then each rank's own (rank-prefixed: two reported)
    f1 = replace(two.findings[1], localization=replace(two.findings[1].localization, note="ran out of probes"))
    assert header_note(replace(two, findings=(two.findings[0], f1))) == \
        "rank 2 missed the straggler deadline; rank 1: ran out of probes"


def test_the_layers_line_leads_with_the_largest_share_even_unflagged_z_beside():
    """Issue 33: transformer.wte carried 31.7% (not flagged) while the header led with h.2.* at 3–4% (flagged)."""
    from gradloc.agent.render_correlated import flagged_layers_text
    from gradloc.records import LayerStats

    inc = make_incident()
    f0 = inc.findings[0]
    g = f0.spike.global_norm
    norms = {"transformer.wte": 0.317, "h.2.attn": 0.04, "h.2.mlp": 0.03, "h.0.mlp": 0.001}
    zs = {"transformer.wte": 1.2, "h.2.attn": 9.0, "h.2.mlp": 12.0, "h.0.mlp": 0.1}
    layers = tuple(LayerStats(layer=n, grad_norm=g * math.sqrt(s), grad_max_abs=1.0, nonfinite=0, param_norm=1.0,
                              numel=4, z=zs[n]) for n, s in norms.items())
    f0 = replace(f0, top_layers=layers, spike=replace(f0.spike, layers=("h.2.mlp", "h.2.attn")))
    inc = replace(inc, findings=(f0,), top_layers=("h.2.mlp", "h.2.attn"))  # the detector's order: largest z first
    assert flagged_layers_text(inc, k=3) == (
        "transformer.wte 31.7% (z 1.2), h.2.attn 4.0% (z 9) ▲, h.2.mlp 3.0% (z 12) ▲ +1 more (% of ‖∇‖², largest "
        "first; 2 of 4 layer(s) flagged ▲: z above the layer z threshold)")


def test_the_follow_up_line_is_named_truly_when_the_incident_step_was_under_it():
    """Issue 33: "1 above the line it crossed (1.994)" for a step whose norm was 1.668 (flagged by another check)."""
    from gradloc.reports import StepPoint

    inc = make_incident()
    hist = tuple(StepPoint(rank=0, step=s, global_norm=1.668 if s == 1200 else 0.9, loss=2.0, norm_mean=0.9,
                           norm_threshold=1.994) for s in range(1190, 1201))
    rows = [StepPoint(rank=0, step=1201, global_norm=2.5, loss=2.0), StepPoint(rank=0, step=1202, global_norm=0.9, loss=2.0)]
    under = incident_html(replace(inc, history=hist, kinds=("layer_spike", "loss_spike")), StoreContext(steps=tuple(rows)))
    assert ("2 after the incident, 1 above the detector's ‖∇‖ line at the incident step (1.994); the incident "
            "step's own ‖∇‖ 1.668 was under it: it was flagged by layer_spike, loss_spike</summary>") in under
    assert "line it crossed" not in under
    over = incident_html(replace(inc, history=hist[:-1] + (replace(hist[-1], global_norm=3.5),)), StoreContext(steps=tuple(rows)))
    assert "1 above the detector's ‖∇‖ line at the incident step (1.994), which the incident step's ‖∇‖ 3.5 crossed" in over


def test_the_answer_opens_the_page_and_10000_identical_tokens_collapse():
    """Issue 33's bad input: the verdict, level, culprit text and share come before the summary table; the
    sample of 10,000 ``\\x00`` tokens is a handful of "N × \\x00" runs, not 10,000 spans."""
    from tests.builders import flooded_incident

    page = incident_html(flooded_incident())
    answer = page[page.index('<section class="answer">'):page.index("</section>")]
    assert page.index('<section class="answer">') < page.index('<table class="kv">')
    assert "<b>located</b> at the <b>sample</b> level: culprits carry <b>94.0%</b>" in answer
    assert "share <b>94.0%</b> of ‖∇‖²" in answer
    assert '<span class="tok top"><span class="run" title="121 identical in a row">121 × \\x00</span></span>' in answer
    assert "4939 × \\x00" in answer and "4940 × \\x00" in answer  # the context each side, whole runs
    window = page[page.index("<h3>micro-batch 1 · sample 0"):]
    assert [t[3] for t in _tokens(window)] == ["4939 × \\x00", "121 × \\x00", "4940 × \\x00"]
    assert [t[0] for t in _tokens(window)] == ["w", "tok", "w"]
    assert "positions 4939–5059 · score share up to 0.7% · culprits, share of ‖∇‖² 94.0%" in window
    assert len(page) < 20_000 and page.count("\\x00") < 20


def test_short_runs_stay_tokens_and_context_runs_collapse():
    from gradloc.agent.page_text import MIN_RUN, collapsed

    span = replace(BELL, window_tokens=("a",) * (MIN_RUN - 1) + (" bell", "b", "b"),
                   window_scores=(0.1,) * (MIN_RUN - 1) + (0.81, 0.0, 0.0), window_start=41 - (MIN_RUN - 1))
    f0 = make_incident().findings[0]
    page = incident_html(replace(make_incident(), findings=(replace(f0, localization=replace(
        f0.localization, spans=(span,))),)))
    assert [t[3] for t in _tokens(page)][:MIN_RUN + 2] == ["a"] * (MIN_RUN - 1) + [" bell", "b", "b"]
    assert collapsed("x" + "ab" * 8 + "<y>") == 'x<span class="run" title="8 identical in a row">8 × ab</span>&lt;y&gt;'
    assert collapsed("ab" * 7) == "ab" * 7  # fewer than MIN_CHAR_RUN repeats: as written


def test_the_page_and_the_cli_name_the_last_healthy_step_to_roll_back_to():
    """make_incident's ranks found steps 1199 and 1198 healthy last: the job's rollback point is the earlier."""
    from gradloc.agent.render_correlated import correlated_text

    inc = make_incident()
    assert inc.last_healthy_step == 1198
    want = "last healthy step 1198 — resume from a checkpoint saved at or before step 1198"
    assert want in incident_html(inc) and want in correlated_text(inc, color=False)
    old = replace(inc, findings=tuple(replace(f, spike=replace(f.spike, last_healthy_step=None)) for f in inc.findings))
    assert old.last_healthy_step is None and "no healthy step before this incident is known" in incident_html(old)
