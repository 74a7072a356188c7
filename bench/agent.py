"""Daemon ingest benchmark: ``python -m bench agent --json``.

A real ``gradloc-agent serve`` process (pinned to one CPU core, with its SQLite store on) receives
step records with ``layers`` layers each from ``clients`` trainer-side client processes, each using
the real :class:`~gradloc.transport.client.AgentClient` (background thread, batching, gRPC). The
clients run on the other cores and pace themselves on their client's queue depth, so the daemon's
capacity, not a client queue, decides the rate.

Measured:

- ``records_per_s``: step records the daemon accepted (its own ``gradloc_agent_records_total``
  counter, read from ``/metrics``) divided by the time from the clients' start to the moment that
  counter reached the number sent;
- ``p99_ingest_to_metrics_s``: a probe client sends one record (job ``probe``) at a time; latency is
  from ``on_step`` until ``/metrics`` shows that step (polled every ``poll_interval_s``, so the
  resolution is that interval; every poll is a full scrape under load);
- ``rss_mb``: the daemon's resident memory, the largest value sampled during and after the load;
- ``drops``: everything lost anywhere — client drops (queue full, send failures, rejections,
  encode failures) plus the daemon's rejections and export drops.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Self

from gradloc.records import LayerShare, LayerStats, StepRecord, TokenScore, TokenStats

ROOT = Path(__file__).resolve().parents[1]  # the checkout whose daemon the benchmarks start


@dataclass(frozen=True)
class AgentBenchConfig:
    clients: int = 8
    layers: int = 256
    records_per_client: int = 4000
    top_k: int = 16
    poll_interval_s: float = 0.1
    daemon_cpu: int = 0
    mode: str = "client"  # "client": the real AgentClient; "raw": pre-encoded batches (saturates the daemon)
    batch: int = 256  # records per batch in raw mode (the client's default max_batch)

    def __post_init__(self) -> None:
        if self.mode not in ("client", "raw"):
            raise ValueError(f"mode must be client or raw, got {self.mode!r}")

    @classmethod
    def quick(cls) -> Self:
        return cls(clients=2, layers=32, records_per_client=200)


def template(layers: int, top_k: int, rank: int) -> StepRecord:
    """One realistic record: ``layers`` layer stats, token stats with ``top_k`` tokens."""
    ls = tuple(LayerStats(layer=f"model.layers.{i // 8}.mlp.proj{i % 8}", grad_norm=0.01 * (1 + i % 7),
                          grad_max_abs=1e-3 * (1 + i % 5), nonfinite=0, param_norm=1.0 + i % 3,
                          numel=4096 * (1 + i % 4), update_ratio=1e-3) for i in range(layers))
    shares = tuple(LayerShare(ls[j].layer, 1 / 3) for j in range(3))
    top = tuple(TokenScore(micro_batch=k % 4, sample=k % 8, position=10 + k, score=1.0 / (k + 1), share=0.02,
                           token_id=1000 + k, sample_id=f"s{rank}-{k}", layers=shares)
                for k in range(top_k))
    tokens = TokenStats(tokens=8192, total_score=12.5, top=top, top_share=0.02,
                        micro_batch_shares=(0.25, 0.25, 0.25, 0.25), unattributed_share=0.01)
    return StepRecord(job="bench", rank=rank, step=0, time_unix=time.time(), global_norm=1.0, loss=2.5,
                      micro_batches=4, layers=ls, tokens=tokens)


def _raw_batches(cfg: AgentBenchConfig, rank: int) -> list[bytes]:
    """The client's wire format, encoded up front with the real codec (raw mode)."""
    from gradloc.transport.codec import LayerTables, batch_bytes, encode_step
    from gradloc.transport.wire import SCHEMA_VERSION, pb

    base = template(cfg.layers, cfg.top_k, rank)
    names = tuple(s.layer for s in base.layers)
    table_id, index = LayerTables().lookup(names)
    steps = [encode_step(replace(base, step=s, time_unix=time.time()), table_id, index, "bench", rank)
             .SerializeToString() for s in range(cfg.records_per_client)]
    out = []
    for seq, i in enumerate(range(0, len(steps), cfg.batch)):
        header = pb.IngestBatch(schema_version=SCHEMA_VERSION, sequence=seq, client=pb.ClientInfo(
            job="bench", rank=rank, world_size=cfg.clients, client_id=f"{rank:032x}"))
        header.layer_tables.add(id=table_id, names=names)
        out.append(batch_bytes(header, steps[i:i + cfg.batch], []))
    return out


def _raw_proc(address: str, cfg: AgentBenchConfig, rank: int, start: Any, out: Any, ready: Any) -> None:
    import grpc

    from gradloc.transport.wire import INGEST_METHOD

    _off_daemon_cpu(cfg)
    batches = _raw_batches(cfg, rank)
    failed = 0
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(INGEST_METHOD)
        ready.put(rank)
        start.wait()
        for data in batches:
            for attempt in range(100):
                try:
                    call(data, timeout=30)
                    break
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.UNAVAILABLE:  # overloaded: back off, retry
                        failed += 1
                        break
                    time.sleep(0.05 * (attempt + 1))
    out.put({"send_failed": failed})


def _off_daemon_cpu(cfg: Any) -> None:
    """Keep this process off the daemon's core (``cfg.daemon_cpu``)."""
    if len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {cfg.daemon_cpu})


def _client_proc(address: str, cfg: AgentBenchConfig, rank: int, start: Any, out: Any, ready: Any) -> None:
    from gradloc.transport.client import AgentClient

    _off_daemon_cpu(cfg)
    base = template(cfg.layers, cfg.top_k, rank)
    client = AgentClient(address, job="bench", rank=rank, world_size=cfg.clients)
    limit = int(client.config.queue_size * 0.8)
    ready.put(rank)
    start.wait()
    for step in range(cfg.records_per_client):
        while client.queued > limit:  # pace on the queue: measure the daemon, not a full client queue
            time.sleep(0.0005)
        client.on_step(replace(base, step=step, time_unix=time.time()))
    client.force_flush(120)
    client.shutdown(30)
    out.put(client.counters)


def _metric(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _start_daemon(tmp: Path, cpu: int, *flags: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """``gradloc-agent serve`` of this checkout (PYTHONPATH), pinned to ``cpu``, store in ``tmp``."""
    ready = tmp / "ready.json"
    cmd = [sys.executable, "-m", "gradloc.agent.cli", "serve", "--ingest", "127.0.0.1:0", "--http", "127.0.0.1:0",
           "--db", str(tmp / "bench.db"), "--ready-file", str(ready), "--log-level", "warning", *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.Popen(cmd, stderr=open(tmp / "agent.log", "wb"), env=env,
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"agent did not start: {(tmp / 'agent.log').read_text()}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


class _Probe:
    """Sends one probe record at a time and times until /metrics shows it; samples the daemon's RSS."""

    def __init__(self, addr: dict[str, str], cfg: AgentBenchConfig, pid: int) -> None:
        import psutil

        from gradloc.transport.client import AgentClient

        self.url, self.cfg = f"http://{addr['http']}/metrics", cfg
        self.client = AgentClient(addr["ingest"], job="probe", rank=0, flush_interval_s=0.01)
        self.base = replace(template(cfg.layers, cfg.top_k, 0), job="probe")
        self.proc = psutil.Process(pid)
        self.latencies: list[float] = []
        self.rss: list[float] = []
        self.step = 0
        self.busy = float("nan")  # daemon CPU seconds per wall second during the load

    def scrape(self) -> str:
        with urllib.request.urlopen(self.url, timeout=30) as resp:
            text = resp.read().decode()
        self.rss.append(self.proc.memory_info().rss / 2**20)
        return text

    def once(self, timeout_s: float = 10.0) -> str:
        self.step += 1
        sent = time.monotonic()
        self.client.on_step(replace(self.base, step=self.step, time_unix=time.time()))
        while True:
            text = self.scrape()
            if _metric(text, "gradloc_step", 'job="probe",rank="0"') >= self.step:
                self.latencies.append(time.monotonic() - sent)
                return text
            if time.monotonic() - sent > timeout_s:
                self.latencies.append(float("inf"))
                return text
            time.sleep(self.cfg.poll_interval_s)


def run_agent_bench(cfg: AgentBenchConfig, progress: Callable[[int, int, Any], None] | None = None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gradloc-bench-") as tmp:
        daemon, addr = _start_daemon(Path(tmp), cfg.daemon_cpu)
        try:
            return _measure(cfg, ctx, daemon, addr, progress)
        finally:
            daemon.terminate()
            daemon.wait(60)


def _measure(cfg: AgentBenchConfig, ctx: Any, daemon: subprocess.Popen[bytes], addr: dict[str, str],
             progress: Callable[[int, int, Any], None] | None) -> dict[str, Any]:
    start, out, ready = ctx.Event(), ctx.Queue(), ctx.Queue()
    target = _raw_proc if cfg.mode == "raw" else _client_proc
    procs = [ctx.Process(target=target, args=(addr["ingest"], cfg, r, start, out, ready)) for r in range(cfg.clients)]
    for p in procs:
        p.start()
    probe = _Probe(addr, cfg, daemon.pid)
    probe.once()  # warm: connection up, layer table known
    for _ in procs:  # every client imported, connected (and in raw mode encoded) before the clock starts
        ready.get(timeout=300)
    time.sleep(0.5)
    total = cfg.clients * cfg.records_per_client
    cpu0 = sum(probe.proc.cpu_times()[:2])
    t0 = time.monotonic()
    start.set()
    accepted, t_end = 0.0, None
    while t_end is None and time.monotonic() - t0 < 600:
        text = probe.once()
        accepted = _metric(text, "gradloc_agent_records_total", 'kind="step"') - probe.step
        if progress:
            progress(int(accepted), total, f"{accepted:.0f}/{total} records")
        if accepted >= total:
            t_end = time.monotonic()
            probe.busy = (sum(probe.proc.cpu_times()[:2]) - cpu0) / (t_end - t0)
    counters = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    for _ in range(5):  # steady state after the load
        text = probe.once()
        time.sleep(0.2)
    return _result(cfg, total, accepted, t0, t_end, probe, counters, text)


def _result(cfg: AgentBenchConfig, total: int, accepted: float, t0: float, t_end: float | None,
            probe: _Probe, counters: list[dict[str, int]], text: str) -> dict[str, Any]:
    client_drops = sum(c.get(k, 0) for c in counters
                       for k in ("queue_full", "send_failed", "encode_failed", "rejected", "after_shutdown"))
    daemon_drops = sum(float(v) for v in re.findall(r"^gradloc_(?:agent_rejected|export_dropped)_total\{[^}]*\} (\S+)$",
                                                     text, re.M))
    lat = sorted(probe.latencies)
    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
    return {
        "records_per_s": round(total / (t_end - t0), 1) if t_end else None, "mode": cfg.mode,
        "rss_mb": round(max(probe.rss), 1),
        "p99_ingest_to_metrics_s": round(p99, 4),
        "drops": int(client_drops + daemon_drops),
        "records_sent": total, "records_accepted": int(accepted), "layers": cfg.layers, "clients": cfg.clients,
        "latency_samples": len(lat), "median_ingest_to_metrics_s": round(statistics.median(lat), 4),
        "poll_interval_s": cfg.poll_interval_s, "rss_mb_final": round(probe.rss[-1], 1),
        "daemon_cpus": 1, "daemon_cpu_busy": round(probe.busy, 3),
        "records_per_daemon_cpu_s": round(total / (t_end - t0) / probe.busy, 1) if t_end and probe.busy > 0 else None, "client_cpus": max(1, len(os.sched_getaffinity(0)) - 1),
    }


def format_table(res: dict[str, Any]) -> str:
    return "\n".join(f"{k:28s} {v}" for k, v in res.items())
