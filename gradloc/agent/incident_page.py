"""The incident page: one self-contained HTML document per incident (no script, no external resource:
it works offline and from a file), and the index of incidents.

Served by the daemon and embedded mode at ``/incidents/<id>`` and ``/incidents``, written by
``gradloc-agent incidents show ID --html FILE``. Shows the summary; SVG charts of the global norm (with
the detector's band) and the loss over the steps around the incident, and the follow-up steps
(:mod:`gradloc.agent.page_chart`); per rank, the detector's view, the localization, every layer's share
of ‖∇‖² and z-score (flagged ones marked), every sample's attributed and measured share, and each culprit
sample's text around the span with every token coloured by its share of the step's per-token attribution
score (``CulpritSpan.window_*``; an incident from a client without them colours the culprit tokens by
their measured share of ‖∇‖² and shows the context uncoloured), the culprit spans outlined, RL fields and
the trace id. Every client string goes through :func:`gradloc.agent.escape.visible` then ``html.escape``.
"""
from __future__ import annotations

import html
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gradloc.agent.page_chart import esc as _e
from gradloc.agent.page_chart import history_section
from gradloc.agent.page_chart import num as _num
from gradloc.agent.page_patterns import patterns_html
from gradloc.agent.page_precursors import preceded_html, precursors_html
from gradloc.agent.page_text import answer_html, collapsed, run_html, token_runs
from gradloc.agent.patterns import Patterns
from gradloc.agent.render import group_text, provenance_text
from gradloc.agent.render_correlated import (
    flagged_layers_text,
    header_note,
    layer_shares,
    ranks_summary,
    rollback_text,
)
from gradloc.agent.store_context import StoreContext
from gradloc.records import Culprit, Incident, SampleOutlier
from gradloc.reports import CorrelatedIncident
from gradloc.store.history import SeenBefore
from gradloc.store.rows import IncidentRow

_CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:1em auto;max-width:70em;padding:0 1em;color:#222;
overflow-wrap:anywhere}h1{margin:.2em 0}td{overflow-wrap:anywhere}.kv td:first-child,th{white-space:nowrap}
.answer{border:2px solid #c0392b;border-radius:4px;padding:.1em .9em;margin:.5em 0 1em;background:#fff8f6}
.answer p{margin:.35em 0}.answer .tok{background:rgba(231,76,60,.35)}.verdict{font-size:1.15em}.answer .text{max-height:9em;overflow-y:auto}
.run{background:#eee;border:1px dashed #999;border-radius:2px;padding:0 .2em;margin:0 .1em}
h1{font-size:1.4em}table{border-collapse:collapse}td,th{padding:.2em .6em;border-bottom:1px solid #ddd;text-align:left}
.text{font-family:ui-monospace,monospace;white-space:pre-wrap;background:#fafafa;padding:.6em;border:1px solid #ddd}
.tok{border-radius:2px;outline:1px solid #c0392b}.w{border-radius:2px}.ctx{color:#777}.bar{background:#e67e22;height:.8em;display:inline-block}
.muted{color:#777}.kv td:first-child{color:#555}.chart{display:block;margin:.4em 0}table.num td{font-variant-numeric:tabular-nums}
tr.flagged td:first-child{font-weight:600}.flag{color:#c0392b}details summary{cursor:pointer;color:#555}"""


def _pct(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'">'
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>{body}</body></html>\n")


def incident_html(inc: CorrelatedIncident, context: StoreContext | None = None, base: str = "/incidents/") -> str:
    """The page. ``context``: what the store knows around it (:func:`gradloc.agent.store_context.store_context`):
    the steps around it (the charts then show the follow-up steps; without them the incident's own history), the
    incident a new-cause incident follows (linked at ``base`` + its id), the samples it quarantined, the series
    drifting before it (linked to the index's precursor findings), and the culprits' earlier flags (memory across
    runs)."""
    ctx = context or StoreContext()
    parts = [f"<h1>Incident <code>{_e(inc.incident_id[:12])}</code> · job {_e(inc.job)} · step {inc.step}</h1>",
             preceded_html(ctx.preceded, base), answer_html(inc, header_note(inc)), _follows(inc, ctx.opener_id, base),
             _summary(inc), _memory(ctx), history_section(inc, ctx.steps), _quarantined(ctx.quarantined)]
    for f in inc.findings:
        parts.append(_finding(f, ctx.seen))
    return _page(f"gradloc incident {inc.incident_id[:12]}", "".join(parts))


def _follows(inc: CorrelatedIncident, opener_id: str | None, base: str) -> str:
    """A new-cause incident: which incident's episode it was opened in, linked when the store holds it."""
    if inc.follows is None:
        return ""
    name = f"the incident of step {inc.follows}"
    if opener_id:
        name = f'<a href="{html.escape(base + opener_id, quote=True)}">{_e(name)}</a> (<code>{_e(opener_id[:12])}</code>)'
    else:
        name = _e(name) + " (not in this store)"
    detail = f": {_e(inc.detail)}" if inc.detail else ""
    return f'<p class="follows">Follows {name}: a new cause inside its episode, localized on its own{detail}</p>'


def _summary(inc: CorrelatedIncident) -> str:
    ranks = ranks_summary(inc)
    layers = flagged_layers_text(inc) if inc.top_layers or layer_shares(inc) else "none"
    rows = [("status", inc.status), ("kinds", ", ".join(inc.kinds) or "—"), ("global ‖∇‖", _num(inc.global_norm)),
            ("explained share", _pct(inc.explained_share)), ("probes", inc.probes), ("ranks", ranks),
            ("layers", layers), ("roll back", rollback_text(inc)), ("trace id", inc.trace_id),
            ("note", header_note(inc) or "—")]
    return '<table class="kv">' + "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in rows) + "</table>"


def _finding(f: Incident, seen: Mapping[str, SeenBefore]) -> str:
    sp, loc = f.spike, f.localization
    ratio = f" ({sp.global_norm / sp.mean:.3g}× the healthy mean)" if (
        sp.mean is not None and math.isfinite(sp.global_norm) and sp.mean > 0) else ""
    head = (f"<h2>Rank {f.rank} ({_e(f.scope)} scope)</h2><p>detector: ‖∇‖ <b>{_num(sp.global_norm)}</b>{ratio} against a "
            f"healthy {_num(sp.mean)} ± {_num(sp.std)} (z {_num(sp.z)}); loss {_num(sp.loss)} (healthy "
            f"{_num(sp.loss_mean)}, z {_num(sp.loss_z)}); kinds {_e(', '.join(sp.kinds) or '—')}</p>")
    if sp.detail:  # e.g. a new cause inside an earlier incident's episode (gradloc/detector/detector.py)
        head += f'<p class="muted">{_e(sp.detail)}</p>'
    layers = _layers(f)
    if loc is None:
        return head + "<p>not localized (a trend, not a token event)</p>" + layers
    level = f" at the {_e(loc.level.replace('_', '-'))} level" if loc.level else ""
    passes = f" (+{loc.passes} extra passes)" if loc.passes else ""
    out = [head, f"<p>localized by {_e(loc.method)} with {loc.probes} probe(s){passes}: <b>{_e(loc.status)}</b>{level}; culprits "
                 f"carry {_pct(loc.explained_share)} of ‖∇‖² and {_pct(loc.loss_share)} of the loss; without them ‖∇‖ "
                 f"would be {_num(loc.norm_without_culprits)}</p>"]
    if f.classification is not None:
        out.append(f"<p>class <b>{_e(f.classification.kind)}</b>: {_e(f.classification.reason)}</p>")
    if loc.note:
        out.append(f'<p class="muted">{_e(loc.note)}</p>')
    out += [f"<h3>{_e(group_text(g, f.scope == 'job'))}</h3>" for g in loc.groups]
    out += [layers, _samples(f)]
    top = max((c.share for c in loc.culprits if math.isfinite(c.share)), default=0.0)
    for span in loc.spans:
        cul = [c for c in loc.culprits if (c.micro_batch, c.sample) == (span.micro_batch, span.sample)
               and span.start <= c.position < span.end and (c.rank is None or c.rank == span.rank)]
        out.append(_span(span, sorted(cul, key=lambda c: c.position), top, seen))
    return "".join(out)


def _layers(f: Incident) -> str:
    """Every layer the finding lists, largest share of ‖∇‖² first, with its z-score; flagged ones marked."""
    if not f.top_layers:
        return ""
    g, flagged = f.spike.global_norm, set(f.spike.layers)
    known = math.isfinite(g) and g > 0

    def share(s) -> float:  # noqa: ANN001 - LayerStats
        return (s.grad_norm / g) ** 2 if known and math.isfinite(s.grad_norm) else math.nan

    rows = sorted(f.top_layers, key=lambda s: -share(s) if not math.isnan(share(s)) else math.inf)
    body = "".join(_layer_row(s, share(s), s.layer in flagged) for s in rows)
    missing = [name for name in f.spike.layers if name not in {s.layer for s in f.top_layers}]
    also = f'<p class="muted">also flagged: {_e(", ".join(missing))}</p>' if missing else ""
    no_z = "" if any(s.z is not None for s in f.top_layers) else \
        '<p class="muted">z-scores: — (this client sent its five largest layers, without z-scores)</p>'
    n_flag = sum(1 for s in f.top_layers if s.layer in flagged) + len(missing)
    return (f"<details open><summary>Layers: {len(f.top_layers)} listed, {n_flag} flagged (z above the layer "
            f"threshold), largest share of ‖∇‖² first</summary><table class=\"num\"><tr><th>layer</th><th>share of "
            f"‖∇‖²</th><th>‖∇‖</th><th>z</th><th></th></tr>{body}</table>{also}{no_z}</details>")


def _layer_row(s, share: float, flagged: bool) -> str:  # noqa: ANN001 - LayerStats
    width = max(1, round(200 * share)) if math.isfinite(share) else 0
    mark = '<span class="flag">▲ flagged</span>' if flagged else ""
    bad = f" · non-finite {s.nonfinite}" if s.nonfinite else ""
    cls = ' class="flagged"' if flagged else ""
    return (f'<tr{cls}><td>{_e(s.layer)}</td><td><span class="bar" style="width:{width}px">'
            f"</span> {_pct(share)}</td><td>{_num(s.grad_norm)}</td><td>{_num(s.z)}</td><td>{mark}{bad}</td></tr>")


def _samples(f: Incident) -> str:
    """Every sample the localization lists: its part of the attribution score and its measured share."""
    loc = f.localization
    if loc is None or not loc.samples:
        return ""
    job = f.scope == "job"
    rows = "".join(
        f"<tr>{f'<td>{_e(x.rank)}</td>' if job else ''}<td>{x.micro_batch}</td><td>{x.sample}</td><td>{_e(x.sample_id)}</td>"
        f"<td>{x.tokens}</td><td>{_pct(x.score_share)}</td><td>{_pct(x.share)}</td></tr>" for x in loc.samples)
    head = ("<tr>" + ("<th>rank</th>" if job else "") + "<th>micro-batch</th><th>sample</th><th>sample id</th>"
            "<th>loss tokens</th><th>attributed</th><th>measured share of ‖∇‖²</th></tr>")
    return (f'<h3>Samples carrying the norm</h3><table class="num">{head}{rows}</table><p class="muted">attributed: '
            "the sample's part of the step's per-token attribution score (free); measured: ⟨∇_S, ∇⟩ / ‖∇‖², from a "
            "probe, — where none was spent on it</p>")


def _memory(ctx: StoreContext) -> str:
    """Memory across runs: the culprits flagged before (by origin or sample id) and their sources' earlier flags."""
    items = [f"<li><b>{_e(key)}</b>: {_e(seen.text())}</li>" for key, seen in ctx.seen.items()]
    items += [f"<li>{_e(s.text())}</li>" for s in ctx.sources]
    return f'<h2>Seen before</h2><ul class="seen">{"".join(items)}</ul>' if items else ""


def _quarantined(entries: Sequence[Any]) -> str:
    if not entries:
        return ""
    items = "".join(f"<li>{_e(e.kind)} <b>{_e(e.value)}</b></li>" for e in entries)
    return (f'<h2>Quarantined</h2><p class="muted">kept out of the next run by the quarantine policy '
            f"(gradloc-agent quarantine list; remove to let one back in)</p><ul>{items}</ul>")


def _span(span, culprits: Sequence[Culprit], top: float,  # noqa: ANN001 - CulpritSpan
          seen: Mapping[str, SeenBefore]) -> str:
    pos = f"position {span.start}" if span.end - span.start == 1 else f"positions {span.start}–{span.end - 1}"
    where = (f"{'rank ' + str(span.rank) + ' · ' if span.rank is not None else ''}micro-batch {span.micro_batch} · "
             f"sample {span.sample}" + (f" (id {_e(span.sample_id)})" if span.sample_id else "")
             + f" · {pos} · share {_pct(span.share)}")
    info = span.sample_info
    origin = (f'<p class="origin">from <b>{_e(provenance_text(info, span.start, span.end))}</b></p>'
              if info is not None and (info.provenance or info.tags) else "")
    before = seen.get((info.origin if info is not None else None) or span.sample_id or "")
    if before is not None:
        origin += '<p class="seen">' + _e(before.text()) + "</p>"
    text = _window(span, culprits) if span.window_tokens else _culprits_only(span, culprits, top)
    first = culprits[0] if culprits else None
    bars = "".join(f"<tr><td>{_e(s.layer)}</td><td><span class=\"bar\" style=\"width:{max(1, round(200 * s.share))}px\">"
                   f"</span> {_pct(s.share)}</td></tr>" for s in (first.layers if first else ()))
    caption = (f'<p class="muted">{len(span.window_tokens)} tokens of the sample from position {span.window_start}'
               "; hover a token for its score share</p>") if span.window_tokens else ""
    through = ("<table><tr><th colspan=\"2\">the first culprit's attribution through its largest layers</th></tr>"
               f"{bars}</table>") if bars else ""
    rl = _rl(first) if first is not None and first.rl is not None else ""
    return f"<h3>{where}</h3>{origin}{text}{caption}{through}{rl}"


def _culprits_only(span, culprits: Sequence[Culprit], top: float) -> str:  # noqa: ANN001 - CulpritSpan
    texts = [c.text for c in culprits]
    toks = []
    for i, j in token_runs(texts, [None] * len(texts)):  # identical culprit tokens in a row: one "N × token"
        run, share = culprits[i:j], max((c.share for c in culprits[i:j]), default=0.0)
        where = f"position {run[0].position}" if j - i == 1 else f"positions {run[0].position}–{run[-1].position}"
        body = _e(run[0].text) if j - i == 1 else run_html(j - i, run[0].text)
        toks.append(f'<span class="tok" style="background:rgba(231,76,60,{_alpha(share, top):.2f})" '
                    f'title="{where} · share {_pct(share)}">{body}</span>')
    return (f'<div class="text"><span class="ctx">…{collapsed(span.context_before)}</span>{"".join(toks)}'
            f'<span class="ctx">{collapsed(span.context_after)}…</span></div>')


def _window(span, culprits: Sequence[Culprit]) -> str:  # noqa: ANN001 - CulpritSpan
    """Every window token coloured by its score share (relative to the window's largest); culprits outlined.
    A run of MIN_RUN or more identical tokens of the same kind (culprit or not) is one "N × token" element."""
    measured = {c.position: c.share for c in culprits}
    top = max((x for x in span.window_scores if math.isfinite(x)), default=0.0)
    tokens = list(span.window_tokens[:len(span.window_scores)])  # (as zip: a token without a score is left out)
    kind = [span.start <= span.window_start + i < span.end for i in range(len(tokens))]
    out = []
    for i, j in token_runs(tokens, kind):
        first, last, culprit = span.window_start + i, span.window_start + j - 1, kind[i]
        scores = [x for x in span.window_scores[i:j] if math.isfinite(x)]
        score = max(scores, default=math.nan)
        alpha = 0.85 * score / top if top > 0 and math.isfinite(score) else 0.0
        if j - i == 1:
            title = f"position {first} · score share {_pct(score)}" + (
                f" · culprit, share of ‖∇‖² {_pct(measured.get(first))}" if culprit else "")
            body = _e(tokens[i])
        else:
            shares = [measured[p] for p in range(first, last + 1) if p in measured and math.isfinite(measured[p])]
            title = f"positions {first}–{last} · score share up to {_pct(score)}" + (
                f" · culprits, share of ‖∇‖² {_pct(sum(shares)) if shares else '—'}" if culprit else "")
            body = run_html(j - i, tokens[i])
        out.append(f'<span class="{"tok" if culprit else "w"}" style="background:rgba(231,76,60,'
                   f'{max(alpha, 0.15) if culprit else alpha:.2f})" title="{title}">{body}</span>')
    after = "" if span.context_after == "" else "…"  # "": the sample ends inside the window
    return f'<div class="text">{"…" if span.window_start > 0 else ""}{"".join(out)}{after}</div>'


def _alpha(share: float, top: float) -> float:
    return 0.15 + 0.85 * (share / top) if top > 0 and math.isfinite(share) else 0.15


def _rl(c: Culprit) -> str:
    r = c.rl
    fields = [("log π_train", r.logp), ("log π_trainer − log π_rollout", r.log_ratio),
              ("log π_train − log π_old", r.log_ratio_old), ("advantage", r.advantage), ("ratio", r.ratio)]
    cells = "".join(f"<tr><td>{_e(k)}</td><td>{_num(v)}</td></tr>" for k, v in fields if v is not None)
    return f'<table class="kv"><tr><th colspan="2">RL fields of the first culprit</th></tr>{cells}</table>'


def index_html(rows: Sequence[IncidentRow], base: str = "/incidents/", outliers: Sequence[SampleOutlier] = (),
               link: Callable[[str], str] | None = None, patterns: Patterns | None = None,
               precursors: Sequence[Any] = ()) -> str:
    """The incidents table; ``link`` (incident id -> a signed page link, when the agent has a token): a column
    of links that open one incident's page without the token, to share; ``patterns``: the data groups that
    spike (agent/page_patterns.py); ``precursors``: the drift detector's findings (agent/page_precursors.py)."""
    def share(r: IncidentRow) -> str:
        return f'<td><a href="{html.escape(link(r.incident_id), quote=True)}">signed link</a></td>' if link else ""

    body = "".join(f'<tr><td><a href="{html.escape(base + r.incident_id, quote=True)}">{_e(r.incident_id[:12])}</a>'
                   f"</td><td>{_e(r.job)}</td><td>{r.step}</td><td>{_e(r.status)}</td><td>{_e(', '.join(r.kinds))}</td>"
                   f"<td>{_pct(r.explained_share)}</td><td>{r.probes}</td>{share(r)}</tr>" for r in rows)
    head = ("<tr><th>incident</th><th>job</th><th>step</th><th>status</th><th>kinds</th><th>explained</th><th>probes</th>"
            + ("<th>share (no token needed)</th>" if link else "") + "</tr>")
    return _page("gradloc incidents",
                 f"<h1>Incidents</h1><table>{head}{body}</table>{patterns_html(patterns)}{_outliers(outliers)}"
                 f"{precursors_html(precursors)}")


def _outliers(outliers: Sequence[SampleOutlier]) -> str:
    """Per-sample findings: no probe ran and nothing paged (``/api/outliers``)."""
    if not outliers:
        return ""
    head = ("<tr><th>job</th><th>rank</th><th>step</th><th>kind</th><th>where</th><th>score</th><th>z</th>"
            "<th>baseline</th><th>text</th></tr>")
    body = "".join(f"<tr><td>{_e(o.job)}</td><td>{o.rank}</td><td>{o.step}</td><td>{_e(o.kind)}</td><td>{_where(o)}</td>"
                   f"<td>{_num(o.score)}</td><td>{_num(o.z)}</td><td>{_num(o.baseline)}</td>"
                   f'<td class="text" title="{_e(o.detail)}">{collapsed(o.text)}</td></tr>' for o in outliers)
    return (f"<h2>Sample outliers</h2><p class=\"muted\">Findings, not incidents: samples whose surprise stands out "
            f"against the run's history, sustained RL mismatch.</p><table>{head}{body}</table>")


def _where(o: SampleOutlier) -> str:
    if o.micro_batch is None:
        return "the step"
    span = f" · positions {o.start}–{o.end - 1}" if o.start is not None and o.end is not None and o.end > o.start else ""
    return _e(f"micro-batch {o.micro_batch} · sample {o.sample}" + (f" (id {o.sample_id})" if o.sample_id else "") + span)
