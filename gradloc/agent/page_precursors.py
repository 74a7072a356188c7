"""The drift detector's findings on the incident pages: the index's "Precursor findings" section, and on one
incident's page the series that were drifting before it ("preceded by: attn_entropy of model.layers.1 falling since
step 1200"), linked to that section filtered to the job and statistic. Every client string is escaped (page_chart.esc)."""
from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import replace
from urllib.parse import urlencode

from gradloc.agent.page_chart import esc as _e
from gradloc.agent.page_chart import num as _num
from gradloc.records import PrecursorDriver, PrecursorFinding

PRECEDE_STEPS = 2_000  # a finding this many steps or fewer before an incident's step is shown as preceding it
ANCHOR = "precursor-findings"  # the index section's id


def preceding(findings: Iterable[PrecursorFinding], job: str, step: int) -> tuple[PrecursorFinding, ...]:
    """The findings of ``job`` whose series was drifting before ``step`` (found at most PRECEDE_STEPS steps before it,
    drifting since a step <= it): one per series (statistic, layer, head, trend), its earliest drift, paging when any
    of its findings paged; the earliest drift first."""
    series: dict[tuple[object, ...], list[PrecursorFinding]] = {}
    for f in findings:
        if f.job == job and step - PRECEDE_STEPS <= f.step <= step and f.since_step <= step:
            series.setdefault((f.statistic, f.layer, f.head, f.trend), []).append(f)
    out = []
    for found in series.values():
        first = min(found, key=lambda f: (f.since_step, f.step))
        out.append(replace(first, pages=True) if any(f.pages for f in found) else first)
    return tuple(sorted(out, key=lambda f: (f.since_step, f.statistic, f.layer)))


def series_text(f: PrecursorFinding) -> str:
    """``attn_entropy of model.layers.1 head 3 falling since step 1200`` (plain text: escape it where it goes)."""
    where = f" of {f.layer}" if f.layer else ""
    head = f" head {f.head}" if f.head is not None else ""
    return f"{f.statistic}{where}{head} {f.trend} since step {f.since_step}"


def link(base: str, f: PrecursorFinding) -> str:
    """The index page's precursor section, filtered to the finding's job and statistic (``base``: the pages' root)."""
    return base.rstrip("/") + "?" + urlencode({"job": f.job, "statistic": f.statistic}) + "#" + ANCHOR


def preceded_html(findings: Sequence[PrecursorFinding], base: str) -> str:
    """One incident's line of the series drifting before it ("" when none)."""
    if not findings:
        return ""
    items = "; ".join(f'<a href="{html.escape(link(base, f), quote=True)}">{_e(series_text(f))}</a>'
                      + (' <span class="flag">(paged)</span>' if f.pages else "") for f in findings)
    return f'<p class="preceded">preceded by: {items}</p>'


def precursors_html(findings: Sequence[PrecursorFinding]) -> str:
    """The index section ("" without findings): newest first, as ``/api/precursors`` lists them."""
    if not findings:
        return ""
    head = ("<tr><th>job</th><th>rank</th><th>step</th><th>statistic</th><th>layer</th><th>trend</th><th>since step</th>"
            "<th>value</th><th>baseline</th><th>change</th><th>z</th><th>pages</th><th>driven by</th></tr>")
    body = "".join(
        f'<tr><td>{_e(f.job)}</td><td>{f.rank}</td><td>{f.step}</td><td>{_e(f.statistic)}</td>'
        f'<td>{_e(f.layer + (f" head {f.head}" if f.head is not None else ""))}</td><td>{_e(f.trend)}</td>'
        f"<td>{f.since_step}</td><td>{_num(f.value)}</td><td>{_num(f.baseline)}</td><td>×{_num(f.change)}</td>"
        f'<td>{_num(f.z)}</td><td>{"<b>yes</b>" if f.pages else "no"}</td>'
        f'<td title="{_e(f.detail)}">{_driver(f.drivers[0]) if f.drivers else "—"}</td></tr>' for f in findings)
    return (f'<h2 id="{ANCHOR}">Precursor findings</h2><p class="muted">Findings, not incidents: statistics moving '
            "steadily away from their own history, or swinging far wider (no probe ran); pages = yes once a drift "
            f"persisted and accelerated (gradloc-agent incidents precursors).</p><table>{head}{body}</table>")


def _driver(d: PrecursorDriver) -> str:
    sample = f"sample {d.sample}" + (f" (id {d.sample_id})" if d.sample_id else "")
    origin = f" · from {d.sample_info.origin}" if d.sample_info is not None and d.sample_info.origin else ""
    rank = f"rank {d.rank} · " if d.rank is not None else ""
    return _e(f"step {d.step} · {rank}micro-batch {d.micro_batch} · {sample} · position {d.position}{origin}")
