"""The incident page: one self-contained HTML document per incident (no script, no external resource:
it works offline and from a file), and the index of incidents.

Served by the daemon and embedded mode at ``/incidents/<id>`` and ``/incidents``, written by
``gradloc-agent incidents show ID --html FILE``. Shows each culprit sample's text around the span with
every token coloured by its share of the step's per-token attribution score (``CulpritSpan.window_*``;
an incident from a client without them colours the culprit tokens by their measured share of ‖∇‖²
and shows the context uncoloured), the culprit spans outlined, the localization path, explained
share and probes, per-layer contribution bars, the detector's view of the norm, RL fields and the
trace id. Every client string goes through :func:`gradloc.agent.escape.visible` then ``html.escape``.
"""
from __future__ import annotations

import html
import math
from collections.abc import Sequence

from gradloc.agent.escape import visible
from gradloc.agent.render import group_text
from gradloc.records import Culprit, Incident, SampleOutlier
from gradloc.reports import CorrelatedIncident
from gradloc.store.rows import IncidentRow

_CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:70em;color:#222}
h1{font-size:1.4em}table{border-collapse:collapse}td,th{padding:.2em .6em;border-bottom:1px solid #ddd;text-align:left}
.text{font-family:ui-monospace,monospace;white-space:pre-wrap;background:#fafafa;padding:.6em;border:1px solid #ddd}
.tok{border-radius:2px;outline:1px solid #c0392b}.w{border-radius:2px}.ctx{color:#777}.bar{background:#e67e22;height:.8em;display:inline-block}
.muted{color:#777}.kv td:first-child{color:#555}"""


def _e(text: object) -> str:
    return html.escape(visible(str(text)) if text is not None else "—", quote=True)


def _pct(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def _num(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.4g}"


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'">'
            f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>{body}</body></html>\n")


def incident_html(inc: CorrelatedIncident) -> str:
    parts = [f"<h1>Incident <code>{_e(inc.incident_id[:12])}</code> · job {_e(inc.job)} · step {inc.step}</h1>",
             _summary(inc)]
    for f in inc.findings:
        parts.append(_finding(f))
    return _page(f"gradloc incident {inc.incident_id[:12]}", "".join(parts))


def _summary(inc: CorrelatedIncident) -> str:
    rows = [("status", inc.status), ("kinds", ", ".join(inc.kinds)), ("global ‖∇‖", _num(inc.global_norm)),
            ("explained share", _pct(inc.explained_share)), ("probes", inc.probes),
            ("ranks reported / missing", f"{list(inc.ranks_reported)} / {list(inc.ranks_missing)}"),
            ("trace id", inc.trace_id), ("note", inc.note or "—")]
    return '<table class="kv">' + "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in rows) + "</table>"


def _finding(f: Incident) -> str:
    sp, loc = f.spike, f.localization
    head = (f"<h2>Rank {f.rank} ({_e(f.scope)} scope)</h2><p>detector: ‖∇‖ <b>{_num(sp.global_norm)}</b> against a "
            f"healthy {_num(sp.mean)} ± {_num(sp.std)} (z {_num(sp.z)}); loss {_num(sp.loss)} (healthy "
            f"{_num(sp.loss_mean)}); kinds {_e(', '.join(sp.kinds))}</p>")
    if loc is None:
        return head + "<p>not localized (a trend, not a token event)</p>"
    level = f" at the {_e(loc.level.replace('_', '-'))} level" if loc.level else ""
    passes = f" (+{loc.passes} extra passes)" if loc.passes else ""
    out = [head, f"<p>localized by {_e(loc.method)} with {loc.probes} probe(s){passes}: <b>{_e(loc.status)}</b>{level}; culprits "
                 f"carry {_pct(loc.explained_share)} of ‖∇‖²; without them ‖∇‖ would be "
                 f"{_num(loc.norm_without_culprits)}</p>"]
    if f.classification is not None:
        out.append(f"<p>class <b>{_e(f.classification.kind)}</b>: {_e(f.classification.reason)}</p>")
    if loc.note:
        out.append(f'<p class="muted">{_e(loc.note)}</p>')
    out += [f"<h3>{_e(group_text(g, f.scope == 'job'))}</h3>" for g in loc.groups]
    top = max((c.share for c in loc.culprits if math.isfinite(c.share)), default=0.0)
    for span in loc.spans:
        cul = [c for c in loc.culprits if (c.micro_batch, c.sample) == (span.micro_batch, span.sample)
               and span.start <= c.position < span.end and (c.rank is None or c.rank == span.rank)]
        out.append(_span(span, sorted(cul, key=lambda c: c.position), top))
    return "".join(out)


def _span(span, culprits: Sequence[Culprit], top: float) -> str:  # noqa: ANN001 - CulpritSpan
    where = (f"{'rank ' + str(span.rank) + ' · ' if span.rank is not None else ''}micro-batch {span.micro_batch} · "
             f"sample {span.sample}" + (f" (id {_e(span.sample_id)})" if span.sample_id else "")
             + f" · positions {span.start}–{span.end - 1} · share {_pct(span.share)}")
    text = _window(span, culprits) if span.window_tokens else _culprits_only(span, culprits, top)
    first = culprits[0] if culprits else None
    bars = "".join(f"<tr><td>{_e(s.layer)}</td><td><span class=\"bar\" style=\"width:{max(1, round(200 * s.share))}px\">"
                   f"</span> {_pct(s.share)}</td></tr>" for s in (first.layers if first else ()))
    rl = _rl(first) if first is not None and first.rl is not None else ""
    return f"<h3>{where}</h3>{text}" + (f"<table>{bars}</table>" if bars else "") + rl


def _culprits_only(span, culprits: Sequence[Culprit], top: float) -> str:  # noqa: ANN001 - CulpritSpan
    toks = "".join(f'<span class="tok" style="background:rgba(231,76,60,{_alpha(c.share, top):.2f})" '
                   f'title="position {c.position} · share {_pct(c.share)}">{_e(c.text)}</span>' for c in culprits)
    return (f'<div class="text"><span class="ctx">…{_e(span.context_before)}</span>{toks}<span class="ctx">'
            f'{_e(span.context_after)}…</span></div>')


def _window(span, culprits: Sequence[Culprit]) -> str:  # noqa: ANN001 - CulpritSpan
    """Every window token coloured by its score share (relative to the window's largest); culprits outlined."""
    measured = {c.position: c.share for c in culprits}
    top = max((x for x in span.window_scores if math.isfinite(x)), default=0.0)
    out = []
    for i, (text, score) in enumerate(zip(span.window_tokens, span.window_scores)):
        pos = span.window_start + i
        alpha = 0.85 * score / top if top > 0 and math.isfinite(score) else 0.0
        culprit = span.start <= pos < span.end
        title = f"position {pos} · score share {_pct(score)}" + (
            f" · culprit, share of ‖∇‖² {_pct(measured.get(pos))}" if culprit else "")
        out.append(f'<span class="{"tok" if culprit else "w"}" style="background:rgba(231,76,60,'
                   f'{max(alpha, 0.15) if culprit else alpha:.2f})" title="{title}">{_e(text)}</span>')
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


def index_html(rows: Sequence[IncidentRow], base: str = "/incidents/", outliers: Sequence[SampleOutlier] = ()) -> str:
    body = "".join(f'<tr><td><a href="{html.escape(base + r.incident_id, quote=True)}">{_e(r.incident_id[:12])}</a>'
                   f"</td><td>{_e(r.job)}</td><td>{r.step}</td><td>{_e(r.status)}</td><td>{_e(', '.join(r.kinds))}</td>"
                   f"<td>{_pct(r.explained_share)}</td><td>{r.probes}</td></tr>" for r in rows)
    head = "<tr><th>incident</th><th>job</th><th>step</th><th>status</th><th>kinds</th><th>explained</th><th>probes</th></tr>"
    return _page("gradloc incidents", f"<h1>Incidents</h1><table>{head}{body}</table>{_outliers(outliers)}")


def _outliers(outliers: Sequence[SampleOutlier]) -> str:
    """Per-sample findings: no probe ran and nothing paged (``/api/outliers``)."""
    if not outliers:
        return ""
    head = ("<tr><th>job</th><th>rank</th><th>step</th><th>kind</th><th>where</th><th>score</th><th>z</th>"
            "<th>baseline</th><th>text</th></tr>")
    body = "".join(f"<tr><td>{_e(o.job)}</td><td>{o.rank}</td><td>{o.step}</td><td>{_e(o.kind)}</td><td>{_where(o)}</td>"
                   f"<td>{_num(o.score)}</td><td>{_num(o.z)}</td><td>{_num(o.baseline)}</td>"
                   f'<td class="text" title="{_e(o.detail)}">{_e(o.text)}</td></tr>' for o in outliers)
    return (f"<h2>Sample outliers</h2><p class=\"muted\">Findings, not incidents: samples whose surprise stands out "
            f"against the run's history, sustained RL mismatch.</p><table>{head}{body}</table>")


def _where(o: SampleOutlier) -> str:
    if o.micro_batch is None:
        return "the step"
    span = f" · positions {o.start}–{o.end - 1}" if o.start is not None and o.end is not None and o.end > o.start else ""
    return _e(f"micro-batch {o.micro_batch} · sample {o.sample}" + (f" (id {o.sample_id})" if o.sample_id else "") + span)
