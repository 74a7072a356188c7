"""One line that says what an incident found, at the level where the data went wrong.

``Localization.summary()`` / ``Incident.summary()`` (what the README's recipe prints), the demo's output
and ``gradloc-agent incidents show`` all phrase the answer through :func:`localization_summary`: the
status and level, what was named at that level (the token or span with its text, the sample, the
micro-batch, the rank), the culprits' measured share of ‖∇‖², and the probes it took. Extra passes
(the decomposition probe's forward-only passes, a rank probe's further micro-batches, the on_spike
re-run) are counted apart from the ≤ 3 probes, as ``Localization.passes`` is.

Pure string work on frozen records (no torch): the agent side imports it. Client text is shown as
``repr`` does (control and format characters escaped); a run of one repeated character is collapsed.
"""
from __future__ import annotations

import re
from typing import Any

# the records are incidents.py's Localization and Incident, typed Any here: incidents.py imports this module
# (their summary() methods), so this one does not import it back

TEXT_SHOWN = 40  # characters of a culprit's text in the line
MIN_CHAR_RUN = 8  # repeats of one short unit (1-8 characters) shown once with its count
_REPEAT = re.compile(r"(.{1,8}?)\1{%d,}" % (MIN_CHAR_RUN - 1), re.S)


def repeats(text: str) -> list[tuple[str, int]]:
    """``text`` as (piece, 1) plain pieces and (unit, N) runs of >= MIN_CHAR_RUN repeats of a 1-8 character
    unit: a sample of 10,000 identical tokens is one run, shown as "10000 × unit", not one unbreakable line."""
    out, at = [], 0
    for m in _REPEAT.finditer(text):
        if m.start() > at:
            out.append((text[at:m.start()], 1))
        out.append((m.group(1), len(m.group(0)) // len(m.group(1))))
        at = m.end()
    return out + ([(text[at:], 1)] if at < len(text) else [])


def _pct(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def quoted(text: str | None) -> str:
    """A culprit's text for one line: repr-escaped, a text that is one run of :func:`repeats` as "121 × '\\x00'"."""
    if text is None:
        return "?"
    runs = repeats(text)
    if len(runs) == 1 and runs[0][1] > 1:  # the whole text one run: "121 × '\x00'"
        return f"{runs[0][1]} × {runs[0][0]!r}"
    return repr(text if len(text) <= TEXT_SHOWN else text[: TEXT_SHOWN - 1] + "…")


def bare(text: str) -> str:
    """A name (job, sample id) with control and format characters escaped as ``repr`` does, unquoted."""
    return text if text.isprintable() else repr(text)[1:-1]


def _where(x: Any, job_scope: bool) -> str:
    rank = f"rank {x.rank} · " if job_scope and getattr(x, "rank", None) is not None else ""
    uid = f" (id {bare(x.sample_id)})" if getattr(x, "sample_id", None) else ""
    return f"{rank}micro-batch {x.micro_batch} · sample {x.sample}{uid}"


def _named(loc: Any, job_scope: bool) -> tuple[str, int]:
    """What the localization named at its level, and how many more of the same it named."""
    level = str(loc.level)
    if level in ("micro_batch", "rank") and loc.groups:
        g = loc.groups[0]
        if g.micro_batch is None:
            what = f"rank {g.rank} (all {g.micro_batches} micro-batches, {g.samples} samples, {g.tokens} loss tokens)"
        else:
            rank = f"rank {g.rank} · " if job_scope and g.rank is not None else ""
            what = f"{rank}micro-batch {g.micro_batch} ({g.samples} samples, {g.tokens} loss tokens)"
        return what, len(loc.groups) - 1
    if level == "sample" and loc.samples and not loc.spans:
        x = loc.samples[0]
        return f"{_where(x, job_scope)} ({x.tokens} loss tokens)", len(loc.samples) - 1
    if loc.spans:
        s = loc.spans[0]
        pos = f"position {s.start}" if s.end - s.start == 1 else f"positions {s.start}–{s.end - 1}"
        return f"{_where(s, job_scope)} · {pos} {quoted(s.text)}", len(loc.spans) - 1
    if loc.culprits:
        c = loc.culprits[0]
        return f"{_where(c, job_scope)} · position {c.position} {quoted(c.text)}", len(loc.culprits) - 1
    return "", 0


def localization_summary(loc: Any, job_scope: bool = False) -> str:
    """E.g. "located at the token level: micro-batch 3 · sample 1 (id s180-3-1) · position 41 ' bell' ·
    99.4% of ‖∇‖² · 1 probe(s)". ``job_scope``: name the rank of each culprit (an incident across ranks)."""
    status = str(loc.status)
    level = str(loc.level).replace("_", "-")
    head = f"{status} at the {level} level" if level else status
    what, more = _named(loc, job_scope)
    parts = [f"{head}: {what}" + (f" (+{more} more)" if more > 0 else "") if what else head]
    if status == "diffuse" and not what:
        parts[0] += ": no token, span, sample or micro-batch carries the spike"
    if loc.explained_share is not None:
        parts.append(f"{_pct(loc.explained_share)} of ‖∇‖²")
    elif status == "unverified":
        parts.append("shares attributed, not measured (no probe closure)")
    passes = f" (+{loc.passes} extra pass(es))" if loc.passes else ""
    parts.append(f"{loc.probes} probe(s){passes}" + (f" by {loc.method}" if str(loc.method) == "bisection" else ""))
    if status == "unavailable" and loc.note:
        parts.append(bare(loc.note))
    return " · ".join(parts)


def incident_summary(inc: Any) -> str:
    """E.g. "incident f5b5f5ea9a10 · job demo · step 180: located at the token level: …" (the id's first
    12 hex digits: what the store, the CLI and the page show; any prefix resolves)."""
    head = f"incident {bare(inc.incident_id[:12])} · job {bare(inc.job)} · step {inc.step}"
    if inc.localization is None:
        return f"{head}: {', '.join(inc.spike.kinds)} · not localized (a trend, not a token event)"
    return f"{head}: {localization_summary(inc.localization, str(inc.scope) == 'job')}"
