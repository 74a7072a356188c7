"""One info-level log line per incident the daemon closes (stored, when it has a store)::

    gradloc-agent: incident 90e42e565abe… job lm step 412 complete · located at the sample level: micro-batch 1 ·
        sample 3 (12 loss tokens) · 94.0% of ‖∇‖² · 2 probe(s) · http://127.0.0.1:19917/incidents/90e42e565abe…

The answer is ``CorrelatedIncident.answer()``: the one line the trainer, the demo and the CLI print
(gradloc/records/summary.py).

A sink of :class:`gradloc.agent.core.AgentCore` (run after the store put, so the link opens when the
line appears). The link is the page on this daemon's HTTP address, never signed: a signature in a log
file would open the page like a password (``gradloc/agent/links.py``); with a token, ``gradloc-agent
incidents show ID`` prints a signed one. Client text (a culprit's tokens) is escaped and cut short.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from gradloc.agent.escape import visible
from gradloc.reports import CorrelatedIncident, StepSummary

log = logging.getLogger("gradloc.agent.daemon")


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

        base = self._page_base()
        link = base + page_path(inc.incident_id) if base else "no page (the HTTP server is not up)"
        log.info("gradloc-agent: incident %s job %s step %d %s · %s · %s",
                 inc.incident_id, visible(inc.job), inc.step, inc.status, inc.answer(), link)
