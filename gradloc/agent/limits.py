"""The daemon's per-job limits on what a client may make it keep (configurable, enforced, counted).

Applied to each accepted batch before its incidents are journaled (gradloc/agent/daemon.py):

- ``max_incidents_per_minute`` per job: a token bucket (refilled continuously, burst = one minute's
  worth). Incidents over it are dropped — still acknowledged, so the client does not retry them —
  and counted ``gradloc_agent_limited_total{limit="incident_rate"}``. A job whose every step spikes
  is a broken run, and its thousandth incident tells nothing the first did not.
- ``max_culprits`` per incident: culprits and spans beyond it (they arrive sorted by share) are cut,
  counted ``limit="culprits"`` (per incident cut), and the note says so.

Other limits are elsewhere: message size (``max_message_bytes``, rejected ``oversized``), layers per
step and jobs × ranks tracked (``max_layers``, ``max_series``: the telemetry state, counted in
``gradloc_agent_series_dropped_total``), step rows per job (``retention_step_rows``).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from gradloc.records import Incident


class IncidentLimits:
    def __init__(self, per_minute: int, max_culprits: int, count: Callable[[str, int], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute, self.max_culprits, self.count, self.clock = per_minute, max_culprits, count, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # job -> (tokens, last refill time)

    def admit(self, incidents: tuple[Incident, ...]) -> list[tuple[int, Incident]]:
        """(position in the batch, incident cut to ``max_culprits``) of those to keep, counting what the
        limits took. Positions stay the batch's: the inbox keys a re-sent batch by them."""
        out = []
        for i, inc in enumerate(incidents):
            if not self._take(inc.job):
                self.count("incident_rate", 1)
                continue
            out.append((i, self._cut(inc)))
        return out

    def _take(self, job: str) -> bool:
        now = self.clock()
        tokens, last = self._buckets.get(job, (float(self.per_minute), now))
        tokens = min(float(self.per_minute), tokens + (now - last) * self.per_minute / 60.0)
        ok = tokens >= 1.0
        self._buckets[job] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > 65_536:  # jobs come and go: forget the full (idle) buckets
            self._buckets = {j: b for j, b in self._buckets.items() if b[0] < self.per_minute}
        return ok

    def _cut(self, inc: Incident) -> Incident:
        out = cut_culprits(inc, self.max_culprits)
        if out is not inc:
            self.count("culprits", 1)
        return out


def cut_culprits(inc: Incident, max_culprits: int) -> Incident:
    """``inc`` with at most ``max_culprits`` culprits and spans (the first: they arrive sorted by
    share) and a note saying what was cut; ``inc`` itself when nothing was."""
    loc = inc.localization
    if loc is None or (len(loc.culprits) <= max_culprits and len(loc.spans) <= max_culprits):
        return inc
    note = f"{loc.note}; " if loc.note else ""
    cut = replace(loc, culprits=loc.culprits[:max_culprits], spans=loc.spans[:max_culprits],
                  note=f"{note}the agent kept the first {max_culprits} of {len(loc.culprits)} culprits and of "
                       f"{len(loc.spans)} spans (max_culprits)")
    return replace(inc, localization=cut)
