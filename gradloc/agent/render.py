"""Terminal and JSON renderings of incidents (pure functions: no click, no I/O)."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from gradloc.agent.escape import terminal, visible, visible_runs
from gradloc.records import (
    Classification,
    Culprit,
    CulpritGroup,
    CulpritSpan,
    Incident,
    Localization,
    Remedy,
    SampleInfo,
    SampleShare,
    TokenRL,
    to_dict,
)
from gradloc.records.packed_origin import span_documents

_HL, _DIM, _BOLD, _OFF = "\x1b[1;97;41m", "\x1b[2m", "\x1b[1m", "\x1b[0m"


def _pct(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def _num(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x:.4g}"


def _visible(text: str | None) -> str:
    return visible(text)


def highlight(span: CulpritSpan, color: bool) -> str:
    """Context before, the culprit tokens (highlighted, or in [[ ]] without colour), context after; a run of
    repeats shown once with its count (``⟨121 × \\x00⟩``: a flood of identical tokens is not a 40,000-character line)."""
    before, text, after = (visible_runs(x) for x in (span.context_before, span.text, span.context_after))
    if color:
        return f"{_DIM}…{before}{_OFF}{_HL}{text}{_OFF}{_DIM}{after}…{_OFF}"
    return f"…{before}[[{text}]]{after}…"


def incident_text(inc: Incident, color: bool = True) -> str:
    """The incident for a terminal; every client-supplied string has its control characters escaped."""
    return terminal(_incident_text(inc, color))


def _incident_text(inc: Incident, color: bool) -> str:
    b = (lambda s: f"{_BOLD}{s}{_OFF}") if color else (lambda s: s)
    sp = inc.spike
    who = f"all ranks (emitted by rank {inc.rank})" if inc.scope == "job" else f"rank {inc.rank}"
    lines = [b(f"incident {inc.incident_id[:12]} · job {inc.job} · {who} · step {inc.step}"),
             f"  detected: {', '.join(sp.kinds)} — ‖∇‖ {_num(sp.global_norm)} (healthy {_num(sp.mean)}, "
             f"z {_num(sp.z)}); loss {_num(sp.loss)} (healthy {_num(sp.loss_mean)}, z {_num(sp.loss_z)})"]
    loc = inc.localization
    if loc is None:
        lines.append("  not localized: this kind of event is a trend, not a token event")
        lines += _remedy_lines(inc.remedy)
        return "\n".join(lines)
    lines += _outcome(loc, inc.scope == "job")
    if inc.classification is not None:
        lines.append(f"  class: {inc.classification.kind} — {inc.classification.reason}")
    if loc.note:
        lines.append(f"  note: {loc.note}")
    lines += _remedy_lines(inc.remedy)
    if loc.samples and (not loc.spans or any(x.share is not None for x in loc.samples)):  # measured: always shown
        lines += ["  samples carrying the norm:", *(_sample_line(x, inc.scope == "job") for x in loc.samples)]
    lines += [f"  • {group_text(g, inc.scope == 'job')}" for g in loc.groups]
    by_span = {(c.micro_batch, c.sample, c.position): c for c in loc.culprits}
    for span in loc.spans:
        uid = f" (sample id {span.sample_id})" if span.sample_id else ""
        pos = f"position {span.start}" if span.end - span.start == 1 else f"positions {span.start}–{span.end - 1}"
        lines.append(f"  • {_rank_of(span.rank, inc.scope == 'job')}micro-batch {span.micro_batch} · sample {span.sample}{uid} · {pos} · "
                     f"share {_pct(span.share)}")
        lines.append(f"      {highlight(span, color)}")
        first = by_span.get((span.micro_batch, span.sample, span.start))
        if first is not None and first.layers:
            lines.append("      through " + ", ".join(f"{s.layer} {_pct(s.share)}" for s in first.layers[:4]))
        if span.sample_info is not None and (span.sample_info.provenance or span.sample_info.tags):
            lines.append(f"      from: {provenance_text(span.sample_info, span.start, span.end)}")
        if span.sample_info is not None and span.sample_info.request_id is not None:
            si = span.sample_info
            lines.append(f"      rollout: request {si.request_id!r} completion {si.completion_index} · response token "
                         f"{span.start - si.response_start} of {si.response_tokens} · finish {si.finish_reason}")
        if first is not None and first.rl is not None:
            lines.append("      rl: " + _rl_text(first.rl) + (f" → {first.classification.kind}" if first.classification else ""))
    if not loc.spans and not loc.groups:
        lines.append("  no culprit tokens found")
    return "\n".join(lines)


def provenance_text(info: SampleInfo, start: int | None = None, end: int | None = None) -> str:
    """"source · origin [key=value, …]": where a sample came from, as far as its loader said; with a span's
    positions [start, end) of a packed row (Megatron), also the document they lie in (records/packed_origin.py)."""
    tags = ", ".join(f"{k}={v}" for k, v in info.tags)
    doc = span_documents(info, start, end) if start is not None and end is not None else None
    return " ".join(x for x in (info.provenance, f"[{tags}]" if tags else "", f"— {doc}" if doc else "") if x)


def group_text(g: CulpritGroup, job_scope: bool = False) -> str:
    """A culprit micro-batch or rank, in words: where, what it holds, its measured share."""
    where = f"rank {g.rank} · every micro-batch ({g.micro_batches})" if g.micro_batch is None else \
        f"{_rank_of(g.rank, job_scope)}micro-batch {g.micro_batch}"
    return f"{where} · {g.samples} sample(s) · {g.tokens} loss token(s) · share {_pct(g.share)}"


def _outcome(loc: Localization, job_scope: bool = False) -> list[str]:
    """The answer (``Localization.summary``: the line the README's recipe prints), then the measured detail."""
    lines = [f"  {loc.summary(job_scope)}"]
    if loc.status == "located" or loc.explained_share is not None:
        lines.append(f"  culprits carry {_pct(loc.explained_share)} of ‖∇‖² and {_pct(loc.loss_share)} of the loss; "
                     f"without them ‖∇‖ would be {_num(loc.norm_without_culprits)}")
    return lines


def _rl_text(r: TokenRL) -> str:
    parts = [("π_train", None if r.logp is None else f"{math.exp(r.logp):.3g}"),
             ("log π_trainer−π_rollout", None if r.log_ratio is None else f"{r.log_ratio:+.3g}"),
             ("log π_train−π_old", None if r.log_ratio_old is None else f"{r.log_ratio_old:+.3g}"),
             ("A", None if r.advantage is None else f"{r.advantage:+.3g}"),
             ("ratio", None if r.ratio is None else f"{r.ratio:.3g}"), ("clipped", None if r.clipped is None else str(r.clipped))]
    return " · ".join(f"{k} {v}" for k, v in parts if v is not None)


def _rank_of(rank: int | None, job_scope: bool) -> str:
    """"rank r · " in a job-scope incident (its culprits live on several ranks), "" otherwise."""
    return f"rank {rank} · " if job_scope and rank is not None else ""


def _sample_line(x: SampleShare, job_scope: bool = False) -> str:
    uid = f" (sample id {x.sample_id})" if x.sample_id else ""
    measured = f"{_pct(x.share)} of ‖∇‖² measured, " if x.share is not None else ""
    return (f"  • {_rank_of(x.rank, job_scope)}micro-batch {x.micro_batch} · sample {x.sample}{uid} · {measured}"
            f"{_pct(x.score_share)} attributed")


def _remedy_lines(r: Remedy | None) -> list[str]:
    if r is None:
        return []
    if r.applied:
        return [f"  remedy {r.action}: applied — ‖∇‖ {_num(r.norm_before)} → {_num(r.norm_after)} ({r.reason})"]
    return [f"  remedy {r.action}: not applied — {r.reason}"]


def incident_line(inc: Incident) -> str:
    """One line: step, kinds, norm, and the answer (``Localization.summary``)."""
    loc = inc.localization
    head = f"step {inc.step} · {', '.join(inc.spike.kinds)} · ‖∇‖ {_num(inc.spike.global_norm)} (z {_num(inc.spike.z)})"
    if loc is None:
        return terminal(head + " · not localized")
    return terminal(f"{head} · {loc.summary(inc.scope == 'job')}")


def culprit_json(c: Culprit, rank: int = 0) -> dict[str, Any]:
    """A culprit in the demo's ``--json``: where (``rank``: the culprit's own, else the incident's rank)
    and what, plus its RL fields and class when it has them."""
    out: dict[str, Any] = {"rank": rank if c.rank is None else c.rank, "micro_batch": c.micro_batch,
                           "sample": c.sample, "position": c.position, "token_id": c.token_id, "text": c.text,
                           "share": c.share, "sample_id": c.sample_id}
    if c.rl is not None:
        out["rl"] = {**to_dict(c.rl), "log_ratio": c.rl.log_ratio, "log_ratio_old": c.rl.log_ratio_old}
    if c.classification is not None:
        out["classification"] = _class_json(c.classification)
    if c.sample_info is not None:
        out["sample_info"] = to_dict(c.sample_info)
    return out


def _class_json(c: Classification) -> dict[str, Any]:
    return {"kind": c.kind, "reason": c.reason, "evidence": {e.name: e.value for e in c.evidence}}


def _sample_json(x: SampleShare, rank: int) -> dict[str, Any]:
    return {"rank": rank if x.rank is None else x.rank, "micro_batch": x.micro_batch, "sample": x.sample,
            "sample_id": x.sample_id, "tokens": x.tokens,
            "score_share": x.score_share, "share": x.share}


def _span_json(x: Any, rank: int) -> dict[str, Any]:
    return {"rank": x.rank if x.rank is not None else rank, "micro_batch": x.micro_batch, "sample": x.sample,
            "sample_id": x.sample_id, "start": x.start, "end": x.end, "share": x.share, "text": x.text}


def demo_json(planted: Sequence[Any], incidents: Sequence[Incident],
              extra: Callable[[Incident], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The demo's ``--json`` object: ``planted`` and ``incidents`` (documented in docs/incident-json.md)."""
    rows = []
    for inc in incidents:
        loc = inc.localization
        rows.append({
            "incident_id": inc.incident_id, "step": inc.step, "rank": inc.rank, "scope": inc.scope,
            "kinds": list(inc.spike.kinds),
            "method": loc.method if loc else None, "status": loc.status if loc else None,
            "level": loc.level if loc else "", "probes": loc.probes if loc else 0,
            "passes": loc.passes if loc else 0,
            "explained_share": loc.explained_share if loc else None,
            "culprits": [culprit_json(c, inc.rank) for c in loc.culprits] if loc else [],
            "spans": [_span_json(x, inc.rank) for x in loc.spans] if loc else [],
            "samples": [_sample_json(x, inc.rank) for x in loc.samples] if loc else [],
            "groups": [{**to_dict(g), "rank": inc.rank if g.rank is None else g.rank} for g in loc.groups] if loc else [],
            "classification": None if inc.classification is None else _class_json(inc.classification),
            "remedy": None if inc.remedy is None else {
                "action": inc.remedy.action, "applied": inc.remedy.applied, "norm_before": inc.remedy.norm_before,
                "norm_after": inc.remedy.norm_after, "reason": inc.remedy.reason},
            **(extra(inc) if extra else {}),
        })
    return {"planted": [dict(p) for p in planted], "incidents": rows}
