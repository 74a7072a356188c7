"""When each (job, rank) last sent anything, and which ones have ended.

The agent keeps per-job state in two places: the correlator (world size, ranks seen, recent steps
per rank) and the telemetry state (gauges, counters and histograms labelled by job and rank). A job
that ends sends nothing more, so nothing tells the agent it ended: a (job, rank) silent for the
agent's ``job_retention_s`` is taken as gone and forgotten, and so is a job once all its ranks are.
Without that a long-lived daemon would keep every job it ever saw.

Owned by the agent core's worker thread. ``ranks`` and ``jobs`` are plain ints that another thread
(``/healthz``) may read at any time.
"""
from __future__ import annotations

from collections.abc import Collection


class Activity:
    def __init__(self) -> None:
        self._last: dict[str, dict[int, float]] = {}  # job -> rank -> time of its latest item
        self.ranks = 0  # (job, rank) pairs tracked
        self.jobs = 0

    def touch(self, job: str, rank: int, now: float) -> None:
        """(job, rank) sent something at ``now`` (called once per ingested item: keep it cheap)."""
        last = self._last.get(job)
        if last is None:
            last = self._last[job] = {}
            self.jobs += 1
        if rank not in last:
            self.ranks += 1
        last[rank] = now

    def expire(self, cutoff: float, keep: Collection[str] = ()) -> tuple[list[tuple[str, int]], list[str]]:
        """Stop tracking what was silent since before ``cutoff``; returns (ranks of jobs that go on,
        jobs whose every rank went). Jobs in ``keep`` (an incident still open) are left alone."""
        ranks: list[tuple[str, int]] = []
        jobs: list[str] = []
        for job, last in list(self._last.items()):
            if job in keep:
                continue
            silent = [r for r, t in last.items() if t < cutoff]
            if not silent:
                continue
            for r in silent:
                del last[r]
            self.ranks -= len(silent)
            if last:
                ranks += [(job, r) for r in silent]
            else:
                del self._last[job]
                self.jobs -= 1
                jobs.append(job)
        return ranks, jobs
