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
from gradloc.agent.render import _BOLD, _OFF, _num, _pct, highlight, incident_text
from gradloc.records import CulpritSpan
from gradloc.reports import CorrelatedIncident, RankShare
from gradloc.store.rows import IncidentRow

_LIST_HEADER = ("ID", "TIME", "JOB", "STEP", "STATUS", "KINDS", "‖∇‖", "EXPLAINED", "MISSING")
_RANK_HEADER = ("RANK", "SHARE", "‖∇‖", "LOSS", "FLAGGED", "STATUS", "PROBES")
FLAGGED_SHOWN = 5  # flagged layers named in the header (the rest: "+N more")


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


def correlated_text(inc: CorrelatedIncident, color: bool = True, opener_id: str | None = None) -> str:
    """The whole incident: header, ranks, per-rank and per-micro-batch shares, culprit spans, then
    every rank's own finding as :func:`gradloc.agent.render.incident_text` prints it. ``opener_id``: the
    id of the incident a new-cause incident follows (``inc.follows``), when known."""
    b = (lambda s: f"{_BOLD}{s}{_OFF}") if color else (lambda s: s)
    lines = _header(inc, b, opener_id)
    lines += ["", b("per-rank shares"), *_rank_table(inc)]
    lines += ["", b("per-micro-batch shares"), *_micro_batch_lines(inc)]
    lines += ["", b("culprit spans, largest share first"), *_span_lines(inc, color)]
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
             (f"  ranks: expected {ranks_text(inc.ranks_expected)} · reported {ranks_text(inc.ranks_reported)} · "
              f"missing {ranks_text(inc.ranks_missing)}")]
    if inc.top_layers:
        lines.append(f"  flagged layers: {flagged_layers_text(inc)}")
    if inc.follows is not None:
        opener = f" (id {opener_id})" if opener_id else ""
        lines.append(f"  follows: the incident of step {inc.follows}{opener}, whose episode this step is a new cause in")
    if inc.detail:
        lines.append(f"  detector: {inc.detail}")
    if inc.note:
        lines.append(f"  note: {inc.note}")
    return lines


def layer_shares(inc: CorrelatedIncident) -> dict[str, float]:
    """Each layer's share of ‖∇‖² at the spike, (layer norm / global norm)², the largest over the findings
    (a finding lists every layer since the z field, the five largest before)."""
    out: dict[str, float] = {}
    for f in inc.findings:
        g = f.spike.global_norm
        for s in f.top_layers:
            if math.isfinite(g) and g > 0 and math.isfinite(s.grad_norm):
                out[s.layer] = max(out.get(s.layer, 0.0), (s.grad_norm / g) ** 2)
    return out


def flagged_layers_text(inc: CorrelatedIncident, k: int = FLAGGED_SHOWN) -> str:
    """The ``k`` flagged layers that matter most (largest share of ‖∇‖² first; layers without a known share
    after, in the detector's order), then "+N more" and how many of the model's layers were flagged."""
    shares = layer_shares(inc)
    order = sorted(inc.top_layers, key=lambda name: -shares.get(name, -1.0))  # stable: unknown shares keep z order
    shown = ", ".join(f"{name} {_pct(shares[name])}" if name in shares else name for name in order[:k])
    more = f" +{len(order) - k} more" if len(order) > k else ""
    complete = [len(f.top_layers) for f in inc.findings if any(s.z is not None for s in f.top_layers)]
    total = f" of {max(complete)}" if complete else ""
    what = "; % of ‖∇‖²" if any(name in shares for name in order[:k]) else ""
    return f"{shown}{more} ({len(order)}{total} layer(s) above the layer z threshold{what})"


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


def _span_lines(inc: CorrelatedIncident, color: bool) -> list[str]:
    lines = []
    for rs in sorted(inc.spans, key=lambda rs: -rs.share if not math.isnan(rs.share) else math.inf):
        s = rs.span
        uid = f" (sample id {s.sample_id})" if s.sample_id else ""
        lines.append(f"  • rank {rs.rank} · micro-batch {s.micro_batch} · sample {s.sample}{uid} · "
                     f"{_positions(s)} · share {_pct(rs.share)}")
        lines.append(f"      {highlight(s, color)}")
    return lines or ["  no culprit tokens found"]
