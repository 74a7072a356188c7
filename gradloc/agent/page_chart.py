"""Inline SVG charts of the incident page: the global gradient norm with the detector's band, and the
loss, over the steps around the incident (the incident step marked).

Plain SVG elements with presentation attributes: no script, no external resource, nothing the page's
CSP (``default-src 'none'; style-src 'unsafe-inline'``) blocks, and every tooltip is an SVG
``<title>``. The points come from :attr:`CorrelatedIncident.history` (the steps the agent held when
the incident closed, with the band each was judged against) and, when the caller has a store, its
``steps`` rows around the incident (the follow-up steps; the store keeps no band). Bad values (NaN
norms, no history, no band) draw as "—" or not at all, never raise.
"""
from __future__ import annotations

import html
import logging
import math
from collections.abc import Sequence
from typing import Any

from gradloc.agent.escape import visible
from gradloc.reports import CorrelatedIncident, StepPoint

log = logging.getLogger(__name__)
STEPS_AROUND = 64  # steps before and after the incident a chart shows at most
_W, _LEFT, _RIGHT, _TOP, _BOTTOM = 760, 70, 16, 12, 30
_RED, _BLUE, _GREY = "#c0392b", "#2c6fbb", "#777"


def esc(text: object) -> str:
    """A client string for HTML text or an attribute: control and invisible characters made visible, then escaped."""
    return html.escape(visible(str(text)) if text is not None else "—", quote=True)


def num(x: float | None) -> str:
    """Four significant digits, "—" for None, NaN and ±inf written out."""
    if x is None or x != x:
        return "—"
    return f"{x:.4g}" if math.isfinite(x) else ("+inf" if x > 0 else "-inf")


def chart_rank(inc: CorrelatedIncident) -> int | None:
    """The rank whose steps the charts show: the history's, else the lowest that sent a finding."""
    if inc.history:
        return inc.history[0].rank
    return min((f.rank for f in inc.findings), default=None)


def chart_points(inc: CorrelatedIncident, steps: Sequence[Any] = ()) -> tuple[StepPoint, ...]:
    """The incident's history merged with store rows (``StepRow``-like: ``rank``, ``step``, ``global_norm``,
    ``loss``) of the same rank; the history wins where both have a step. At most ``STEPS_AROUND`` steps each side."""
    rank = chart_rank(inc)
    by_step = {p.step: p for p in steps_as_points(steps) if p.rank == rank}
    by_step.update((p.step, p) for p in inc.history)
    lo, hi = inc.step - STEPS_AROUND, inc.step + STEPS_AROUND
    return tuple(by_step[s] for s in sorted(by_step) if lo <= s <= hi)


def steps_as_points(steps: Sequence[Any]) -> list[StepPoint]:
    out = []
    for r in steps:
        try:
            norm = float(r.global_norm) if r.global_norm is not None else math.nan
            out.append(StepPoint(rank=int(r.rank), step=int(r.step), global_norm=norm,
                                 loss=None if r.loss is None else float(r.loss)))
        except (AttributeError, TypeError, ValueError):  # a row of another shape: left out, never raised
            continue
    return out


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


class _Axis:
    """Value -> pixel on [lo, hi] (log10 when every value is > 0), from the bottom pixel up to the top one."""

    def __init__(self, values: Sequence[float], bottom: float, top: float, log: bool) -> None:
        vals = [math.log10(v) if log else v for v in values]
        lo, hi = min(vals), max(vals)
        pad = (hi - lo) * 0.08 if hi > lo else (0.5 if log else max(abs(hi) * 0.1, 1e-12))
        self.lo, self.hi, self.log, self.bottom, self.top = lo - pad, hi + pad, log, bottom, top

    def __call__(self, v: float) -> float:
        x = math.log10(v) if self.log else v
        return self.bottom - (x - self.lo) / (self.hi - self.lo) * (self.bottom - self.top)

    def ticks(self) -> list[float]:
        if self.log:
            decades = [10.0 ** k for k in range(math.floor(self.lo), math.ceil(self.hi) + 1)]
            fine = [d * m for d in decades for m in (1, 2, 5)] if len(decades) <= 3 else decades
            return [t for t in fine if self.lo <= math.log10(t) <= self.hi]
        return _nice(self.lo, self.hi)


def _nice(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round values in [lo, hi]."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _frame(height: int, label: str, xs: "_XAxis", y: _Axis, y_name: str) -> list[str]:
    """The axes, the y ticks and grid, the x ticks and the y axis's name."""
    bottom = height - _BOTTOM
    out = [f'<rect x="{_LEFT}" y="{_TOP}" width="{_W - _LEFT - _RIGHT}" height="{bottom - _TOP}" fill="#fff" '
           f'stroke="#ccc"/>']
    for t in y.ticks():
        py = y(t)
        out.append(f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{py:.1f}" y2="{py:.1f}" stroke="#eee"/>'
                   f'<text x="{_LEFT - 6}" y="{py + 4:.1f}" text-anchor="end" font-size="11" fill="{_GREY}">'
                   f"{num(t)}</text>")
    for s in xs.ticks():
        px = xs(s)
        out.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{bottom}" y2="{bottom + 4}" stroke="#999"/>'
                   f'<text x="{px:.1f}" y="{bottom + 16}" text-anchor="middle" font-size="11" fill="{_GREY}">{s}</text>')
    out.append(f'<text x="14" y="{(_TOP + bottom) / 2:.0f}" font-size="11" fill="{_GREY}" text-anchor="middle" '
               f'transform="rotate(-90 14 {(_TOP + bottom) / 2:.0f})">{esc(y_name)}</text>')
    return [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" width="{_W}" height="{height}" '
            f'viewBox="0 0 {_W} {height}" font-family="system-ui,sans-serif"><title>{esc(label)}</title>', *out]


class _XAxis:
    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, max(last, first + 1)

    def __call__(self, step: int) -> float:
        return _LEFT + 8 + (step - self.first) / (self.last - self.first) * (_W - _LEFT - _RIGHT - 16)

    def ticks(self) -> list[int]:
        return sorted({int(round(t)) for t in _nice(self.first, self.last, 6) if self.first <= t <= self.last})


def _polylines(pts: Sequence[tuple[float, float] | None], color: str, cls: str) -> list[str]:
    """One polyline per run of known points (a None breaks the line)."""
    out, run = [], []
    for p in [*pts, None]:
        if p is not None:
            run.append(p)
            continue
        if len(run) > 1:
            out.append(f'<polyline class="{cls}" fill="none" stroke="{color}" stroke-width="1.5" points="'
                       + " ".join(f"{x:.1f},{y:.1f}" for x, y in run) + '"/>')
        run = []
    return out


def _marker(xs: _XAxis, step: int, height: int) -> str:
    px = xs(step)
    return (f'<line class="incident" x1="{px:.1f}" x2="{px:.1f}" y1="{_TOP}" y2="{height - _BOTTOM}" stroke="{_RED}" '
            f'stroke-dasharray="4 3"><title>the incident: step {step}</title></line>'
            f'<text x="{px + 5:.1f}" y="{height - _BOTTOM - 6}" font-size="11" fill="{_RED}">step {step}</text>')


def norm_chart(points: Sequence[StepPoint], incident_step: int, line: float | None = None) -> str:
    """The global norm (log scale when every value is > 0) with the band, the incident marked. ``line``: the
    grad_spike line at the incident, drawn dashed over the steps after it (the store keeps no band)."""
    height = 250
    band = [(p.step, p.norm_mean, p.norm_threshold) for p in points
            if _finite(p.norm_mean) and _finite(p.norm_threshold)]
    values = [p.global_norm for p in points if _finite(p.global_norm)] + \
             [v for _, m, t in band for v in (m, t)] + ([line] if _finite(line) else [])
    if not values:
        return '<p class="muted">no step history to chart: —</p>'
    xs = _XAxis(min(p.step for p in points), max(p.step for p in points))
    y = _Axis(values, height - _BOTTOM, _TOP, log=all(v > 0 for v in values))
    out = _frame(height, f"global gradient norm over steps {xs.first}–{xs.last}", xs, y, "‖∇‖")
    out += _band(band, xs, y)
    after = [p.step for p in points if p.step > incident_step]
    if _finite(line) and after:
        out.append(f'<line class="ref" x1="{xs(incident_step):.1f}" x2="{xs(max(after)):.1f}" y1="{y(line):.1f}" '
                   f'y2="{y(line):.1f}" stroke="{_RED}" stroke-opacity=".5" stroke-dasharray="2 3">'
                   f"<title>the detector's ‖∇‖ line at the incident step: {num(line)}</title></line>")
    out += _polylines([(xs(p.step), y(p.global_norm)) if _finite(p.global_norm) else None for p in points],
                      _BLUE, "norm")
    out.append(_marker(xs, incident_step, height))
    for p in points:
        out.append(_norm_point(p, xs, y, incident_step, line))
    return "".join(out) + "</svg>"


def _band(band: Sequence[tuple[int, float, float]], xs: _XAxis, y: _Axis) -> list[str]:
    """Shaded from the healthy mean up to the grad_spike line, one polygon per run of consecutive steps."""
    out, runs, run = [], [], []
    for b in band:
        if run and b[0] != run[-1][0] + 1:
            runs.append(run)
            run = []
        run.append(b)
    runs += [run] if run else []
    for r in runs:
        if len(r) == 1:  # one step: a short bar of the band's width
            r = [(r[0][0] - 0.3, r[0][1], r[0][2]), (r[0][0] + 0.3, r[0][1], r[0][2])]
        top = " ".join(f"{xs(s):.1f},{y(t):.1f}" for s, _, t in r)
        low = " ".join(f"{xs(s):.1f},{y(m):.1f}" for s, m, _ in reversed(r))
        out.append(f'<polygon class="band" points="{top} {low}" fill="#27ae60" fill-opacity=".16" stroke="none">'
                   f"<title>the detector's band: healthy mean up to the grad_spike line</title></polygon>")
        out.append('<polyline class="mean" fill="none" stroke="#27ae60" stroke-dasharray="3 3" points="'
                   + " ".join(f"{xs(s):.1f},{y(m):.1f}" for s, m, _ in r) + '"/>')
    return out


def _norm_point(p: StepPoint, xs: _XAxis, y: _Axis, incident_step: int, line: float | None) -> str:
    px = xs(p.step)
    if not _finite(p.global_norm):  # a NaN or inf norm: a red triangle at the top edge
        return (f'<polygon class="nonfinite" points="{px - 5:.1f},{_TOP} {px + 5:.1f},{_TOP} {px:.1f},{_TOP + 9}" '
                f'fill="{_RED}"><title>step {p.step}: ‖∇‖ {num(p.global_norm)}</title></polygon>')
    limit = p.norm_threshold if _finite(p.norm_threshold) else (line if p.step > incident_step else None)
    above = _finite(limit) and p.global_norm > limit
    hit = p.step == incident_step
    fill = _RED if hit or above else _BLUE
    band = f" · band {num(p.norm_mean)}–{num(p.norm_threshold)}" if _finite(p.norm_threshold) else ""
    return (f'<circle class="pt{" hit" if hit else ""}" cx="{px:.1f}" cy="{y(p.global_norm):.1f}" r="{5 if hit else 2.5}" '
            f'fill="{fill}"><title>step {p.step}: ‖∇‖ {num(p.global_norm)}{band}'
            f'{" (above the line)" if above else ""}</title></circle>')


def loss_chart(points: Sequence[StepPoint], incident_step: int) -> str:
    """The loss over the same steps (linear scale), the incident marked."""
    height = 150
    known = [p for p in points if _finite(p.loss)]
    if not known:
        return '<p class="muted">no loss in the step history: —</p>'
    xs = _XAxis(min(p.step for p in points), max(p.step for p in points))
    y = _Axis([p.loss for p in known], height - _BOTTOM, _TOP, log=False)
    out = _frame(height, f"loss over steps {xs.first}–{xs.last}", xs, y, "loss")
    out += _polylines([(xs(p.step), y(p.loss)) if _finite(p.loss) else None for p in points], "#8e44ad", "loss")
    out.append(_marker(xs, incident_step, height))
    out += [f'<circle class="lpt" cx="{xs(p.step):.1f}" cy="{y(p.loss):.1f}" r="{4 if p.step == incident_step else 2}" '
            f'fill="#8e44ad"><title>step {p.step}: loss {num(p.loss)}</title></circle>' for p in known]
    return "".join(out) + "</svg>"


def page_steps(store: Any, inc: CorrelatedIncident) -> list[Any]:
    """The store's steps around ``inc`` (``STEPS_AROUND`` each side, the chart's rank) for
    ``incident_html(inc, steps=...)``: the follow-up steps the incident itself cannot hold. [] without a store."""
    rank = chart_rank(inc)
    if store is None or rank is None:
        return []
    try:
        return list(store.step_range(inc.job, rank, inc.step - STEPS_AROUND, inc.step + STEPS_AROUND))
    except Exception:  # noqa: BLE001 - the page is drawn without them rather than not at all
        log.warning("gradloc agent: reading the steps around incident %s failed", inc.incident_id, exc_info=True)
        return []


def episode_opener(store: Any, inc: CorrelatedIncident) -> str | None:
    """The id of the incident a new-cause incident follows (``inc.follows``: same job, that step), when
    the store holds it; None otherwise (no store, not a follow-up, the opener not stored or pruned)."""
    if store is None or inc.follows is None:
        return None
    try:
        return store.incident_id_at(inc.job, inc.follows)
    except Exception:  # noqa: BLE001 - the page is drawn without the link rather than not at all
        log.warning("gradloc agent: looking up the incident %s follows failed", inc.incident_id, exc_info=True)
        return None


def history_section(inc: CorrelatedIncident, steps: Sequence[Any] = (), follow_rows: int = 16) -> str:
    """The charts of the steps around the incident, their legend, and the steps after it."""
    points = chart_points(inc, steps)
    at = next((p for p in points if p.step == inc.step), None)
    line = at.norm_threshold if at is not None else None
    rank = chart_rank(inc)
    head = f"<h2>Around the incident{'' if rank is None else f' (rank {rank})'}</h2>"
    if not points:
        return head + ('<p class="muted">no step history: the agent held no step records of this job when the '
                       "incident closed (or it was stored by an older gradloc)</p>")
    legend = ('<p class="muted legend">blue: global ‖∇‖ (log scale) · green: the detector\'s band, from the healthy '
              "mean (dashed) up to the grad_spike line a norm must cross · red: the incident and steps above their "
              "line · dotted red: the line at the incident step, over the steps after it (the store keeps no band)</p>")
    return (head + norm_chart(points, inc.step, line) + loss_chart(points, inc.step) + legend
            + _follow_up(points, inc, line, follow_rows))


def _follow_up(points: Sequence[StepPoint], inc: CorrelatedIncident, line: float | None, rows: int) -> str:
    after = [p for p in points if p.step > inc.step]
    if not after:
        return ('<p class="muted">follow-up steps: none known yet (without a store the page holds only the steps '
                "before the incident)</p>")
    mean = next((f.spike.mean for f in inc.findings if f.rank == chart_rank(inc)), None)
    above = [p for p in after if _finite(line) and _finite(p.global_norm) and p.global_norm > line]
    cells = "".join(
        f"<tr><td>{p.step}</td><td>{num(p.global_norm)}</td><td>{_ratio(p.global_norm, mean)}</td><td>{num(p.loss)}</td>"
        f"<td>{'yes' if p in above else ('—' if not _finite(line) or not _finite(p.global_norm) else 'no')}</td></tr>"
        for p in after[:rows])
    more = f'<p class="muted">+{len(after) - rows} more step(s) in the chart</p>' if len(after) > rows else ""
    return (f'<details class="follow"><summary>Follow-up steps: {len(after)} after the incident, {len(above)} above '
            f"{_line_words(inc, line, points)}</summary><p class=\"muted\">The detector folds flagged steps within its "
            "episode horizon into this incident's episode instead of opening new incidents, unless a step brings a new "
            "cause (new culprit samples shown to be bad data): that step is its own incident, which names this one's "
            "step.</p><table class=\"num\">"
            f"<tr><th>step</th><th>‖∇‖</th><th>× healthy mean</th><th>loss</th><th>above the line</th></tr>{cells}"
            f"</table>{more}</details>")


def _line_words(inc: CorrelatedIncident, line: float | None, points: Sequence[StepPoint]) -> str:
    """The line the follow-up steps are compared with, in true words: the detector's grad_spike line (the
    warm-up line during the warm-up) at the incident step. A step flagged for another reason (a loss, layer
    or token spike) may sit under it: then said, with its norm and kinds, never "the line it crossed"."""
    if not _finite(line):
        return "the detector's line at the incident step (unknown: no band was recorded)"
    words = f"the detector's ‖∇‖ line at the incident step ({num(line)})"
    own = next((p.global_norm for p in points if p.step == inc.step), inc.global_norm)  # the charted rank's
    if _finite(own) and own <= line:
        kinds = ", ".join(str(k) for k in inc.kinds if k not in ("grad_spike", "warmup_spike")) or "another check"
        words += f"; the incident step's own ‖∇‖ {num(own)} was under it: it was flagged by {esc(kinds)}"
    elif _finite(own):
        words += f", which the incident step's ‖∇‖ {num(own)} crossed"
    return words


def _ratio(x: float, mean: float | None) -> str:
    return f"{x / mean:.3g}×" if _finite(x) and _finite(mean) and mean > 0 else "—"
