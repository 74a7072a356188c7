"""Terminal renderings of the incident store: the ``incidents list`` table and a correlated incident.

Pure functions (no click, no I/O), like :mod:`gradloc.agent.render`, whose number formats,
highlighting and per-rank incident text they reuse so a rank's finding reads the same here as in
``gradloc-agent demo``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime

from gradloc.agent.escape import terminal
from gradloc.agent.page_precursors import series_text
from gradloc.agent.render import _BOLD, _OFF, _num, _pct, highlight, incident_text, provenance_text
from gradloc.agent.store_context import StoreContext
from gradloc.records import CulpritSpan
from gradloc.reports import CorrelatedIncident, RankShare
from gradloc.store.rows import IncidentRow

_LIST_HEADER = ("ID", "TIME", "JOB", "STEP", "STATUS", "KINDS", "‖∇‖", "EXPLAINED", "MISSING")
_RANK_HEADER = ("RANK", "SHARE", "‖∇‖", "LOSS", "FLAGGED", "STATUS", "PROBES")
FLAGGED_SHOWN = 5  # layers named in the header, largest share of ‖∇‖² first (the rest: "+N more")


def local_time(t: float, offset: bool = False) -> str:
    """ISO 8601 in the local time zone, to the second (with the UTC offset when asked)."""
    stamp = datetime.fromtimestamp(t).astimezone()
    return stamp.isoformat(timespec="seconds") if offset else stamp.strftime("%Y-%m-%dT%H:%M:%S")


def ranks_text(ranks: Sequence[int]) -> str:
    """``0–3, 5, 7–8``: runs collapsed, because a 512-rank job would not fit a line otherwise."""
    if not ranks:
        return "none"
    out, ordered = [], sorted(ranks)
    start = prev = ordered[0]
    for r in ordered[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}–{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: frozenset[int] = frozenset(),
          indent: str = "") -> list[str]:
    """Rows aligned under ``header``; column indices in ``right`` are right-aligned (numbers)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(parts)).rstrip()

    return [line(header)] + [line(r) for r in rows]


def incident_table(rows: Sequence[IncidentRow]) -> str:
    """The ``incidents list`` table: id prefix, local time, job, step, status, kinds, ‖∇‖, explained, missing."""
    cells = [(r.incident_id[:12], local_time(r.time_unix), r.job, str(r.step), r.status, ",".join(r.kinds),
              _num(r.global_norm), _pct(r.explained_share), ranks_text(r.ranks_missing) if r.ranks_missing else "-")
             for r in rows]
    return terminal("\n".join(table(_LIST_HEADER, cells, right=frozenset({3, 6, 7}))))


def correlated_text(inc: CorrelatedIncident, color: bool = True, context: StoreContext | None = None) -> str:
    """The whole incident: header, ranks, per-rank and per-micro-batch shares, culprit spans, then
    every rank's own finding as :func:`gradloc.agent.render.incident_text` prints it. ``context``: what the store
    knows around it (agent/store_context.py: the incident a new-cause incident follows, the series drifting before
    it, earlier flags of its culprits and their sources), when read from a store."""
    ctx = context or StoreContext()
    b = (lambda s: f"{_BOLD}{s}{_OFF}") if color else (lambda s: s)
    lines = _header(inc, b, ctx.opener_id)
    if ctx.preceded:  # the drift findings of series drifting before it (agent/page_precursors.py)
        lines.append("  preceded by: " + "; ".join(series_text(f) + (" (paged)" if f.pages else "") for f in ctx.preceded))
    lines += ["", b("per-rank shares"), *_rank_table(inc)]
    lines += ["", b("per-micro-batch shares"), *_micro_batch_lines(inc)]
    lines += ["", b("culprit spans, largest share first"), *_span_lines(inc, color, ctx)]
    if ctx.sources:
        lines += [f"  {s.text()}" for s in ctx.sources]
    lines += ["", b(f"findings of the {len(inc.findings)} reporting rank(s)")]
    for finding in sorted(inc.findings, key=lambda f: f.rank):
        lines += [incident_text(finding, color=color), ""]
    return terminal("\n".join(lines).rstrip("\n"))


def _header(inc: CorrelatedIncident, b, opener_id: str | None = None) -> list[str]:
    closed = f" · closed {inc.closed_unix - inc.time_unix:.1f} s later" if inc.closed_unix else ""
    lines = [b(f"incident {inc.incident_id[:12]} · job {inc.job} · step {inc.step} · {inc.status}"),
             f"  answer: {inc.answer()}",
             f"  id {inc.incident_id} · trace {inc.trace_id}",
             f"  time {local_time(inc.time_unix, offset=True)}{closed}",
             (f"  detected: {', '.join(inc.kinds) or 'nothing'} — ‖∇‖ {_num(inc.global_norm)}; culprits "
              f"explain {_pct(inc.explained_share)} of ‖∇‖² (best verified rank), {inc.probes} probe(s) over all ranks"),
             f"  ranks: {ranks_summary(inc)}"]
    if inc.top_layers or layer_shares(inc):
        lines.append(f"  layers: {flagged_layers_text(inc)}")
    if inc.follows is not None:
        opener = f" (id {opener_id})" if opener_id else ""
        lines.append(f"  follows: the incident of step {inc.follows}{opener}, whose episode this step is a new cause in")
    if inc.detail:
        lines.append(f"  detector: {inc.detail}")
    lines.append(f"  roll back: {rollback_text(inc)}")
    if header_note(inc):
        lines.append(f"  note: {header_note(inc)}")
    return lines


def rollback_text(inc: CorrelatedIncident) -> str:
    """Where a restart goes: the last healthy step before the incident's episode (``inc.last_healthy_step``)."""
    n = inc.last_healthy_step
    if n is None:
        return "no healthy step before this incident is known (the detector's first steps, or an older client)"
    return f"last healthy step {n} — resume from a checkpoint saved at or before step {n}"


def ranks_summary(inc: CorrelatedIncident) -> str:
    """The ranks counted for what they are: "single process (rank 0)" for a one-process run, else
    "3 expected (0–2) · 2 reported (0–1) · 1 missing (2)" (counts first: "expected 0" read as zero ranks)."""
    exp, rep, mis = inc.ranks_expected, inc.ranks_reported, inc.ranks_missing
    if len(exp) == 1 and set(rep) <= set(exp) and not mis:
        return f"single process (rank {exp[0]})"

    def part(word: str, ranks: Sequence[int]) -> str:
        return f"{len(ranks)} {word}" + (f" ({ranks_text(ranks)})" if ranks else "")

    expected = part("expected", exp) if exp else "world size unknown"
    return f"{expected} · {part('reported', rep)} · {part('missing', mis) if mis else 'none missing'}"


def header_note(inc: CorrelatedIncident) -> str:
    """The incident's note (the correlator's, e.g. a rank that missed its deadline), then each finding's
    localization note (why it stopped where it did), prefixed with its rank when several ranks reported."""
    notes = [inc.note] if inc.note else []
    many = len(inc.findings) > 1
    for f in sorted(inc.findings, key=lambda f: f.rank):
        loc = f.localization
        if loc is not None and loc.note:
            text = f"rank {f.rank}: {loc.note}" if many else loc.note
            if text not in notes:
                notes.append(text)
    return "; ".join(notes)


def layer_shares(inc: CorrelatedIncident) -> dict[str, float]:
    """Each layer's share of ‖∇‖² at the spike, (layer norm / global norm)², the largest over the findings
    (a finding lists every layer since the z field, the five largest before)."""
    return {name: share for name, (share, _) in _layer_view(inc).items()}


def _layer_view(inc: CorrelatedIncident) -> dict[str, tuple[float, float | None]]:
    """layer -> (share of ‖∇‖², z of the finding with that largest share)."""
    out: dict[str, tuple[float, float | None]] = {}
    for f in inc.findings:
        g = f.spike.global_norm
        for s in f.top_layers:
            if math.isfinite(g) and g > 0 and math.isfinite(s.grad_norm):
                share = (s.grad_norm / g) ** 2
                if s.layer not in out or share > out[s.layer][0]:
                    out[s.layer] = (share, s.z)
    return out


def flagged_layers_text(inc: CorrelatedIncident, k: int = FLAGGED_SHOWN) -> str:
    """The ``k`` layers that carry the most of ‖∇‖² (largest share first, its z beside, the layers the
    detector flagged marked ▲), then "+N more" and how many of the model's layers were flagged. Without
    shares (a client before the z field sent five layers, or no finding), the flagged names in the
    detector's order (largest z first)."""
    view = _layer_view(inc)
    flagged = set(inc.top_layers)
    listed = [f for f in inc.findings if any(s.z is not None for s in f.top_layers)]
    total = f" of {max(len(f.top_layers) for f in listed)}" if listed else ""
    count = f"{len(flagged)}{total} layer(s) flagged ▲: z above the layer z threshold"
    if not view:
        shown = ", ".join(inc.top_layers[:k])
        more = f" +{len(inc.top_layers) - k} more" if len(inc.top_layers) > k else ""
        return f"{shown}{more} ({count})"
    names = sorted(view, key=lambda n: -view[n][0])  # largest share of ‖∇‖² first
    names += [n for n in inc.top_layers if n not in view]  # flagged, share unknown: last, detector's order

    def one(name: str) -> str:
        if name not in view:
            return f"{name} ▲"
        share, z = view[name]
        return f"{name} {_pct(share)}{'' if z is None else f' (z {_num(z)})'}{' ▲' if name in flagged else ''}"

    more = f" +{len(names) - k} more" if len(names) > k else ""
    return f"{', '.join(one(n) for n in names[:k])}{more} (% of ‖∇‖², largest first; {count})"


def _rank_table(inc: CorrelatedIncident) -> list[str]:
    def cells(s: RankShare) -> tuple[str, ...]:
        return (str(s.rank), _pct(s.share), _num(s.global_norm), _num(s.loss), "yes" if s.flagged else "no",
                s.status or "-", str(s.probes))

    rows = [cells(s) for s in sorted(inc.rank_shares, key=lambda s: s.rank)]
    listed = {s.rank for s in inc.rank_shares}
    rows += [(str(r), "-", "-", "-", "-", "did not report", "-") for r in inc.ranks_missing if r not in listed]
    return table(_RANK_HEADER, rows, right=frozenset({0, 1, 2, 3, 6}), indent="  ")


def _micro_batch_lines(inc: CorrelatedIncident) -> list[str]:
    by_rank: dict[int, list[str]] = {}
    for m in sorted(inc.micro_batch_shares, key=lambda m: (m.rank, m.micro_batch)):
        by_rank.setdefault(m.rank, []).append(f"mb {m.micro_batch} {_pct(m.share)}")
    return [f"  rank {r}: " + " · ".join(parts) for r, parts in by_rank.items()] or ["  none reported"]


def _positions(span: CulpritSpan) -> str:
    return f"position {span.start}" if span.end - span.start == 1 else f"positions {span.start}–{span.end - 1}"


def _span_lines(inc: CorrelatedIncident, color: bool, ctx: StoreContext) -> list[str]:
    lines = []
    for rs in sorted(inc.spans, key=lambda rs: -rs.share if not math.isnan(rs.share) else math.inf):
        s = rs.span
        uid = f" (sample id {s.sample_id})" if s.sample_id else ""
        lines.append(f"  • rank {rs.rank} · micro-batch {s.micro_batch} · sample {s.sample}{uid} · "
                     f"{_positions(s)} · share {_pct(rs.share)}")
        lines.append(f"      {highlight(s, color)}")
        if s.sample_info is not None and (s.sample_info.provenance or s.sample_info.tags):
            lines.append(f"      from: {provenance_text(s.sample_info, s.start, s.end)}")
        before = ctx.seen.get((s.sample_info.origin if s.sample_info is not None else None) or s.sample_id or "")
        if before is not None:
            lines.append(f"      {before.text()}")
    return lines or ["  no culprit tokens found"]
