"""One info-level log line per incident the daemon closes (stored, when it has a store)::

    gradloc-agent: incident 90e42e565abe… job lm step 412 complete · level sample · top culprit rank 0 ·
        micro-batch 1 · sample 3 · 94.0% of ‖∇‖² · http://127.0.0.1:19917/incidents/90e42e565abe…

A sink of :class:`gradloc.agent.core.AgentCore` (run after the store put, so the link opens when the
line appears). The link is the page on this daemon's HTTP address, never signed: a signature in a log
file would open the page like a password (``gradloc/agent/links.py``); with a token, ``gradloc-agent
incidents show ID`` prints a signed one. Client text (a culprit's tokens) is escaped and cut short.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

from gradloc.agent.escape import visible
from gradloc.reports import CorrelatedIncident, StepSummary

log = logging.getLogger("gradloc.agent.daemon")
_TEXT_CHARS = 40


def _pct(x: float | None) -> str:
    return "?" if x is None or not math.isfinite(x) else f"{100 * x:.1f}% of ‖∇‖²"


def top_culprit(inc: CorrelatedIncident) -> tuple[str, str]:
    """(level, the top culprit in words) of the lowest reporting rank's localization that located something;
    ("none", "none") when no rank located anything."""
    located = [f for f in sorted(inc.findings, key=lambda f: f.rank)
               if f.localization is not None and f.localization.level]
    if not located:
        return "none", "none"
    loc = located[0].localization
    level = str(loc.level)
    if level in ("token", "span") and inc.spans:
        rs = max(inc.spans, key=lambda r: r.share if math.isfinite(r.share) else -math.inf)
        s = rs.span
        text = visible(s.text)
        text = text if len(text) <= _TEXT_CHARS else text[:_TEXT_CHARS] + "…"
        return level, (f"rank {rs.rank} · micro-batch {s.micro_batch} · sample {s.sample} · positions "
                       f"{s.start}–{s.end - 1} '{text}' · {_pct(rs.share)}")  # escaped once: no repr()
    if level == "sample" and loc.samples:
        s = max(loc.samples, key=lambda s: s.share if s.share is not None else s.score_share)
        rank = located[0].rank if s.rank is None else s.rank
        return level, (f"rank {rank} · micro-batch {s.micro_batch} · sample {s.sample} · "
                       f"{_pct(s.share if s.share is not None else loc.explained_share)}")
    if loc.groups:
        g = max(loc.groups, key=lambda g: g.share)
        rank = located[0].rank if g.rank is None else g.rank
        where = f"rank {rank}" + ("" if g.micro_batch is None else f" · micro-batch {g.micro_batch}")
        return level, f"{where} · {_pct(g.share)}"
    return level, _pct(loc.explained_share)


class IncidentLog:
    """Logs each closed incident at info level; ``page_base`` gives the daemon's page origin
    (``http://host:port``) once its HTTP server is bound (None: no link)."""

    def __init__(self, page_base: Callable[[], str | None]) -> None:
        self._page_base = page_base

    def on_step(self, summary: StepSummary) -> None:
        pass

    def force_flush(self, timeout_s: float) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def on_incident(self, inc: CorrelatedIncident) -> None:
        from gradloc.agent.links import page_path

        level, culprit = top_culprit(inc)
        base = self._page_base()
        link = base + page_path(inc.incident_id) if base else "no page (the HTTP server is not up)"
        log.info("gradloc-agent: incident %s job %s step %d %s · level %s · top culprit %s · %s",
                 inc.incident_id, visible(inc.job), inc.step, inc.status, level, culprit, link)
