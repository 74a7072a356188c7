"""Agent soak: ``python -m bench soak --minutes 10 --json``.

A real ``gradloc-agent serve`` (this checkout, pinned to one core, SQLite store on, a short
``--job-retention-s``) is driven for ``minutes`` at ``rate`` step records per second in all (the
rate docs/BENCHMARKS.md §3 sets for one daemon core) by ``procs`` client processes on the other
cores. Each process runs ``jobs_per_proc`` job slots; a slot runs a job of ``ranks`` real
:class:`~gradloc.transport.client.AgentClient` s (one per rank) for ``job_s`` seconds, shuts it
down and starts the next job under a new name, so jobs start and end all through the run and the
daemon must forget the ended ones. Rank 0 of every job reports an incident every
``incident_every`` steps (the other ranks' step records close it as complete) and one more at the
job's end for a step no rank records (closed as partial at the straggler deadline). The clients
never pace on their queues: a daemon that falls behind shows up as drops. The ranks pace on the
clock like trainers: a rank whose process did not get the CPU skips the steps it missed
(``generator_skipped``) rather than sending them in a burst, so ``rate_achieved`` below ``rate``
with few skipped steps means the daemon was slow, with many that the load generator was.

Every ``sample_s`` the daemon's RSS, ``/metrics`` (series, accepted records, pending correlations,
rejections) and ``/healthz`` (jobs and ranks tracked) are sampled. After the load, the run waits
for the retention to pass and checks that nothing of the soak's jobs is left.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import statistics
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from bench.agent import _metric, _start_daemon
from bench.soak_load import SoakConfig, load_proc

DROPS = ("queue_full", "send_failed", "encode_failed", "rejected", "after_shutdown")


class _Sampler:
    """The daemon's RSS, /metrics and /healthz, every ``sample_s``."""

    def __init__(self, addr: dict[str, str], pid: int) -> None:
        import psutil

        self.base = f"http://{addr['http']}"
        self.proc = psutil.Process(pid)
        self.samples: list[dict[str, Any]] = []
        self.rss: list[tuple[float, float]] = []  # (t_s, MB) every second: medians over windows of them

    def rss_mb(self, t: float) -> float:
        mb = round(self.proc.memory_info().rss / 2**20, 1)
        self.rss.append((round(t, 1), mb))
        return mb

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base + path, timeout=60) as resp:
            return resp.read().decode()

    def sample(self, t: float) -> dict[str, Any]:
        t_scrape = time.monotonic()
        text = self.get("/metrics")
        t_scrape = time.monotonic() - t_scrape
        health = json.loads(self.get("/healthz"))
        lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
        row = {
            "t_s": round(t, 1), "rss_mb": self.rss_mb(t), "series": len(lines),
            "soak_series": sum('job="soak-' in ln for ln in lines),
            "records": int(_metric(text, "gradloc_agent_records_total", 'kind="step"')),
            "incident_records": int(_metric(text, "gradloc_agent_records_total", 'kind="incident"')),
            "pending": int(_unlabelled(text, "gradloc_agent_pending_correlations")),
            "jobs": health["jobs"], "ranks": health["ranks"], "scrape_s": round(t_scrape, 3),
            # lost on the daemon: rejected batches and export drops; "overloaded" is backpressure (the client retries)
            "daemon_drops": int(sum(float(v) for reason, v in re.findall(
                r'^gradloc_(?:agent_rejected|export_dropped)_total\{\w+="(\w+)"\} (\S+)$', text, re.M)
                if reason != "overloaded")),
            "overloaded": int(_metric(text, "gradloc_agent_rejected_total", 'reason="overloaded"')),
        }
        self.samples.append(row)
        return row


def _unlabelled(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def run_soak(cfg: SoakConfig, progress: Callable[[int, int, Any], None] | None = None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gradloc-soak-") as tmp:
        daemon, addr = _start_daemon(Path(tmp), cfg.daemon_cpu, "--job-retention-s", str(cfg.job_retention_s),
                                     "--straggler-deadline-s", str(cfg.straggler_deadline_s))
        try:
            res = _soak(cfg, ctx, daemon.pid, addr, progress)
            res["db_mb"] = round((Path(tmp) / "bench.db").stat().st_size / 2**20, 1)
            return res
        finally:
            daemon.terminate()
            daemon.wait(60)


def _soak(cfg: SoakConfig, ctx: Any, pid: int, addr: dict[str, str],
          progress: Callable[[int, int, Any], None] | None) -> dict[str, Any]:
    sampler = _Sampler(addr, pid)
    start, out, ready = ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=load_proc, args=(addr["ingest"], cfg, i, start, out, ready))
             for i in range(cfg.procs)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    idle = sampler.sample(0.0)  # before any load: the daemon's own series only
    load = [os.getloadavg()[0]]
    cpu0 = sum(sampler.proc.cpu_times()[:2])
    t0 = time.monotonic()
    start.set()
    n = int(cfg.duration_s // cfg.sample_s)
    for i in range(1, n + 1):
        due = t0 + i * cfg.sample_s
        while (now := time.monotonic()) < due - 1.0:
            time.sleep(min(1.0, due - 1.0 - now))
            sampler.rss_mb(time.monotonic() - t0)
        time.sleep(max(0.0, due - time.monotonic()))
        row = sampler.sample(time.monotonic() - t0)
        if progress:
            progress(i - 1, n, row)
    counts: Counter[str] = Counter()
    for _ in procs:
        counts.update(out.get(timeout=300))
    for p in procs:
        p.join(60)
    t_load = time.monotonic() - t0
    busy = (sum(sampler.proc.cpu_times()[:2]) - cpu0) / t_load
    load.append(os.getloadavg()[0])
    drained = _drain(cfg, sampler, t0, t_load, counts)
    return _result(cfg, sampler.samples[1:n + 1], sampler.rss, idle, drained, counts, t_load, busy, load)


def _drain(cfg: SoakConfig, sampler: _Sampler, t0: float, t_load: float, counts: Counter[str]) -> dict[str, Any]:
    """After the load: every record accepted, then (retention + straggler deadline + margin) until
    the soak's jobs are forgotten; the first sample with none of them left, or the last one tried."""
    sent = counts["sent_steps"]
    deadline = time.monotonic() + 60 + 3 * cfg.job_retention_s + cfg.straggler_deadline_s
    while True:
        row = sampler.sample(time.monotonic() - t0)
        done = row["records"] >= sent and row["soak_series"] == 0 and row["jobs"] == 0 and row["pending"] == 0
        if done or time.monotonic() > deadline:
            return {**row, "after_load_s": round(row["t_s"] - t_load, 1), "complete": done}
        time.sleep(min(1.0, cfg.job_retention_s / 4))


def _median_rss(rss: list[tuple[float, float]], lo: float, hi: float) -> float:
    vals = [mb for t, mb in rss if lo <= t <= hi]
    return round(statistics.median(vals), 1) if vals else float("nan")


def _result(cfg: SoakConfig, during: list[dict[str, Any]], rss: list[tuple[float, float]], idle: dict[str, Any],
            drained: dict[str, Any], counts: Counter[str], t_load: float, busy: float,
            load: list[float]) -> dict[str, Any]:
    """``during``: the full samples taken while the load ran; ``rss``: every second's RSS."""
    dur = cfg.duration_s
    warm = cfg.warmup_end_s
    span = 0.1 * dur  # medians over a window, not one value: RSS moves with batches in flight and scrapes
    rss_warm = _median_rss(rss, warm, warm + span)
    rss_end = _median_rss(rss, dur - span, dur)
    client_drops = sum(counts[k] for k in DROPS)
    after = [r for r in during if r["t_s"] >= warm]
    return {
        "minutes": cfg.minutes, "target_rate": cfg.rate, "encode": cfg.encode, "layers": cfg.layers,
        "concurrent_jobs": cfg.procs * cfg.jobs_per_proc, "ranks_per_job": cfg.ranks, "job_s": cfg.job_s,
        "job_retention_s": cfg.job_retention_s, "straggler_deadline_s": cfg.straggler_deadline_s,
        "records_offered": counts["offered_steps"], "generator_skipped": counts["skipped_slots"],
        "records_sent": counts["sent_steps"],
        "records_accepted": drained["records"],
        "rate_achieved": round(during[-1]["records"] / during[-1]["t_s"], 1), "load_s": round(t_load, 1),
        "incidents_sent": counts["incidents"], "incident_records_accepted": drained["incident_records"],
        "jobs_run": counts["jobs"],
        "client_drops": client_drops, "client_drop_counts": {k: counts[k] for k in DROPS if counts[k]},
        "daemon_drops": drained["daemon_drops"], "overloaded_answers": drained["overloaded"],
        "rss_mb_idle": idle["rss_mb"], "rss_mb_after_warmup": rss_warm, "rss_mb_end": rss_end,
        "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 1),
        "rss_mb_max": max(mb for t, mb in rss if t <= dur), "rss_windows_s": [[warm, warm + span], [dur - span, dur]],
        "pending_max": max(r["pending"] for r in during), "scrape_s_max": max(r["scrape_s"] for r in during),
        "series_idle": idle["series"], "series_max": max(r["series"] for r in during),
        "series_min_after_warmup": min((r["series"] for r in after), default=None),
        "series_after_drain": drained["series"], "soak_series_after_drain": drained["soak_series"],
        "ranks_tracked_max": max(r["ranks"] for r in during), "jobs_tracked_max": max(r["jobs"] for r in during),
        "jobs_tracked_after_drain": drained["jobs"], "drained": drained["complete"],
        "drained_after_s": drained["after_load_s"],
        "daemon_cpu_busy": round(busy, 3), "loadavg_1m": [round(x, 2) for x in load],
        "cpus": os.cpu_count(), "timeline": during,
    }


def format_table(res: dict[str, Any]) -> str:
    head = "\n".join(f"{k:28s} {v}" for k, v in res.items() if k != "timeline")
    rows = "\n".join(f"{r['t_s']:8.1f} s  rss {r['rss_mb']:7.1f} MB  series {r['series']:6d}  pending {r['pending']:4d}  "
                     f"jobs {r['jobs']:3d}  ranks {r['ranks']:4d}  records {r['records']}" for r in res["timeline"])
    return head + "\n" + rows
