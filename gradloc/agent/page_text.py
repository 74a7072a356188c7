"""The incident page's answer block and its long-run collapsing (pure functions returning HTML).

The answer block opens the page, so its first screen holds what a user came for: the status, the level,
the kinds and norm, and the top culprit's text with its share (else the culprit micro-batch or rank, else
why nothing was named). Runs of identical tokens or characters (a sample of 10,000 ``\\x00`` tokens) are
collapsed into one ``N × token`` element, so no run makes one unbreakable line wider than the page.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from gradloc.agent.escape import repeats
from gradloc.agent.page_chart import esc as _e
from gradloc.agent.page_chart import num as _num
from gradloc.agent.render import group_text
from gradloc.records import Incident
from gradloc.reports import CorrelatedIncident, RankSpan

MIN_RUN = 4  # identical tokens in a row shown as one "N × token"
CONTEXT_CHARS = 160  # the answer block shows at most this much context each side of the culprit text


def pct(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def run_html(count: int, unit: str) -> str:
    return f'<span class="run" title="{count} identical in a row">{count} × {_e(unit)}</span>'


def _render(segments: Sequence[tuple[str, int]]) -> str:
    return "".join(_e(piece) if n == 1 else run_html(n, piece) for piece, n in segments)


def collapsed(text: str | None) -> str:
    """``text`` escaped for HTML with every run of >= MIN_CHAR_RUN repeats of a 1-8 character unit as "N × unit"."""
    return _e(None) if text is None else _render(repeats(text))


def token_runs(tokens: Sequence[str], keys: Sequence[object]) -> Iterator[tuple[int, int]]:
    """(start, end) of each run of equal (token, key) pairs; a run shorter than MIN_RUN is split into singles."""
    i = 0
    while i < len(tokens):
        j = i + 1
        while j < len(tokens) and tokens[j] == tokens[i] and keys[j] == keys[i]:
            j += 1
        if j - i >= MIN_RUN:
            yield i, j
        else:
            yield from ((k, k + 1) for k in range(i, j))
        i = j


def _clip(text: str | None, keep_end: bool) -> str:
    """The context nearest the culprit, collapsed: plain characters up to CONTEXT_CHARS from the culprit's side
    (a run counts as its "N × unit" and is kept whole), "…" where more was left out."""
    segments = repeats(text or "")
    if keep_end:
        segments = [(piece[::-1], n) for piece, n in reversed(segments)]
    kept, room = [], CONTEXT_CHARS
    for piece, n in segments:
        if room <= 0:
            break
        if n == 1 and len(piece) > room:
            piece = piece[:room]
        kept.append((piece, n))
        room -= len(piece) if n == 1 else len(piece) + 8
    cut = sum(len(p) * n for p, n in kept) < len(text or "")
    if keep_end:
        kept = [(piece[::-1], n) for piece, n in reversed(kept)]
        return ("…" if cut else "") + _render(kept)
    return _render(kept) + ("…" if cut else "")


def _top_finding(inc: CorrelatedIncident, top: RankSpan | None) -> Incident | None:
    located = [f for f in inc.findings if f.localization is not None]
    if top is not None:
        same = [f for f in located if f.rank == top.rank]
        if same:
            return same[0]
    return max(located, key=lambda f: f.localization.explained_share or 0.0, default=None)


def answer_html(inc: CorrelatedIncident, note: str) -> str:
    """The page's first block: verdict line, then the top culprit span's text (or group, or sample)."""
    spans = sorted(inc.spans, key=lambda rs: -rs.share if math.isfinite(rs.share) else math.inf)
    top = spans[0] if spans else None
    f = _top_finding(inc, top)
    loc = f.localization if f is not None else None
    kinds = ", ".join(inc.kinds) or "—"
    if loc is None:
        verdict = f"<b>{_e(inc.status)}</b>: not localized ({_e(kinds)}: a trend, not a token event)"
    else:
        level = f" at the <b>{_e(loc.level.replace('_', '-'))}</b> level" if loc.level else ""
        verdict = (f"<b>{_e(loc.status)}</b>{level}: culprits carry <b>{pct(loc.explained_share)}</b> of ‖∇‖² · "
                   f"{loc.probes} probe(s) · incident {_e(inc.status)}")
    lines = [f'<p class="verdict">{verdict}</p>',
             f'<p class="muted">{_e(kinds)} — ‖∇‖ {_num(inc.global_norm)} at step {inc.step}</p>']
    if top is not None:
        s = top.span
        pos = f"position {s.start}" if s.end - s.start == 1 else f"positions {s.start}–{s.end - 1}"
        uid = f" (id {_e(s.sample_id)})" if s.sample_id else ""
        more = f" · {len(spans) - 1} more span(s) below" if len(spans) > 1 else ""
        lines.append(f'<p>culprit: rank {top.rank} · micro-batch {s.micro_batch} · sample {s.sample}{uid} · {pos} · '
                     f"share <b>{pct(top.share)}</b> of ‖∇‖²{more}</p>")
        lines.append(f'<div class="text culprit"><span class="ctx">{_clip(s.context_before, True)}</span>'
                     f'<span class="tok top">{collapsed(s.text)}</span>'
                     f'<span class="ctx">{_clip(s.context_after, False)}</span></div>')
    elif loc is not None and loc.groups:
        g = max(loc.groups, key=lambda g: g.share if math.isfinite(g.share) else -1.0)
        lines.append(f'<p class="culprit">culprit: {_e(group_text(g, f.scope == "job"))}</p>')
    elif loc is not None and loc.samples:
        x = max(loc.samples, key=lambda x: x.share if x.share is not None else x.score_share)
        lines.append(f'<p class="culprit">top sample: micro-batch {x.micro_batch} · sample {x.sample} · '
                     f"{pct(x.share)} of ‖∇‖² measured, {pct(x.score_share)} attributed</p>")
    else:
        lines.append('<p class="culprit">no culprit named</p>')
    if note:
        lines.append(f'<p class="muted">note: {_e(note)}</p>')
    return f'<section class="answer">{"".join(lines)}</section>'
