"""``gradloc-agent serve``: gRPC ingest from many ranks and jobs, HTTP for scrapes and the API.

    trainers ──gRPC──► ingest threads ──► AgentCore (state → correlator → store / OTLP)
                                              ▲
    Prometheus, CLI, browser ──HTTP──► /metrics, /healthz, /api/incidents

Ingest threads decode and validate a batch (a bad batch is rejected whole, with a gRPC status and
a counted reason) and hand it to the core's bounded queue. When the queue stays full the batch is
refused with UNAVAILABLE, so the client backs off and retries — backpressure instead of silent loss.
Shutdown (SIGTERM/SIGINT) stops accepting, drains the queue, closes open incidents as partial,
flushes the store and the OTLP exporter.
"""
from __future__ import annotations

import faulthandler
import gc
import logging
import signal
import socket
import threading
import time
from typing import Any

from gradloc.agent.config import AgentConfig
from gradloc.agent.core import AgentCore, CoreConfig, Declare, DropReport, Journaled
from gradloc.agent.correlator import CorrelatorConfig
from gradloc.agent.http import AgentHttpServer
from gradloc.agent.incident_log import IncidentLog
from gradloc.agent.limits import IncidentLimits
from gradloc.agent.links import origin
from gradloc.agent.quarantine_policy import QuarantinePolicy
from gradloc.exporters.state import StateConfig

log = logging.getLogger(__name__)


def _open_store(cfg: AgentConfig) -> Any:
    if cfg.db.lower() == "none":
        return None
    from gradloc.store.retention import RetentionConfig
    from gradloc.store.sqlite import IncidentStore, default_db_path

    retention = RetentionConfig(max_age_days=cfg.retention_days, max_incidents=cfg.retention_incidents,
                                max_step_rows=cfg.retention_step_rows)
    return IncidentStore(cfg.db or default_db_path(), retention=retention)


def _inbox_owner(cfg: AgentConfig, store: Any) -> str:
    """Whose inbox rows this daemon commits and, after a restart, correlates again (gradloc/store/inbox.py):
    ``daemon`` on a store of its own (a SQLite file); on a store many daemons share (PostgreSQL), this
    daemon's host and configured ingest address, so that each replays only its own rows and a daemon
    restarted on the same host and port finds them (daemons sharing a store need fixed ingest ports)."""
    if store is None or not store.shared:
        return "daemon"
    return f"daemon:{socket.gethostname()}:{cfg.ingest}"


def _grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 literals go in brackets


class Daemon:
    def __init__(self, config: AgentConfig) -> None:
        self.config = cfg = config
        core_cfg = CoreConfig(queue_size=cfg.queue_size, job_retention_s=cfg.job_retention_s,
                              state=StateConfig(max_series=cfg.max_series, max_layers=cfg.max_layers,
                                                sources=cfg.source_names, max_sources=cfg.max_sources),
                              correlator=CorrelatorConfig(straggler_deadline_s=cfg.straggler_deadline_s),
                              quarantine=QuarantinePolicy(culprits=cfg.quarantine_culprits,
                                                          outlier_z=cfg.quarantine_outlier_z or None))
        self.store = _open_store(cfg)
        self.core = AgentCore(core_cfg, self.store, inbox_owner=_inbox_owner(cfg, self.store))
        if cfg.otlp_endpoint:
            from gradloc.exporters.otlp import OtlpConfig, OtlpExporter

            self.core.exporters.append(OtlpExporter(self.core.state, OtlpConfig(
                endpoint=cfg.otlp_endpoint, export_interval_s=cfg.otlp_interval_s, insecure=cfg.otlp_insecure)))
        self._page_base: str | None = None  # http(s)://host:port of the pages, once the HTTP server is bound
        self.core.exporters.append(IncidentLog(lambda: self._page_base))  # one info line per closed incident
        self.limits = IncidentLimits(cfg.max_incidents_per_minute, cfg.max_culprits,
                                     lambda limit, n: self.core.state.count("limited", (limit,), n))
        self._grpc: Any = None
        self._http: AgentHttpServer | None = None
        self.ingest_address: tuple[str, int] | None = None
        self.http_address: tuple[str, int] | None = None
        self._stopped = threading.Event()

    def start(self) -> "Daemon":
        from gradloc.agent.http import parse_address
        from gradloc.transport.codec import BatchDecoder
        from gradloc.transport.server import start_ingest_server

        security = self.config.security()
        # bound first (port 0 picks one), served after the core starts: the incident log lines name its pages
        self._http = AgentHttpServer(self.core, self.config.http, security)
        self.http_address = self._http.address
        self._page_base = origin(None, self.http_address, security.tls)
        self.core.start()
        # Ingest allocates many short-lived objects: freeze what start-up built, and collect
        # generation 0 less often (a full collection per few batches cost ~25% of ingest time).
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        host, port = parse_address(self.config.ingest)
        decoder = BatchDecoder(max_message_bytes=self.config.max_message_bytes, keep_top_tokens=False)
        try:
            self._grpc, bound = start_ingest_server(self._ingest, self._reject, address=_grpc_address(host, port),
                                                    max_message_bytes=self.config.max_message_bytes,
                                                    decoder=decoder, security=security)
        except BaseException:
            self._http.stop()  # bound, not served: release the port
            raise
        self.ingest_address = (host, bound)
        self._http.start()
        log.info("gradloc-agent: ingest on %s:%d, http on %s:%d", *self.ingest_address, *self.http_address)
        return self

    def _ingest(self, batch: Any) -> None:
        """Take one validated batch. Its incidents are committed to the store's inbox before this
        returns (and the client gets its acknowledgement); a re-sent batch's are recognised there and
        not correlated twice. Step summaries are acknowledged once queued (cheaper: a lost one is a
        gap in a chart, not a lost incident)."""
        c = batch.client
        kept = self.limits.admit(batch.incidents) if batch.incidents else []
        incidents = self._journal(batch, kept) if kept and self.store is not None else [inc for _, inc in kept]
        items: list[Any] = [Declare(c.job, c.rank, c.world_size),
                            DropReport(c.job, c.rank, tuple(batch.drops.items())), *batch.steps, *incidents]
        if not self.core.submit(items, timeout_s=1.0):
            from gradloc.transport.server import Overloaded  # UNAVAILABLE: the client backs off, retries

            journaled = [i.key for i in incidents if isinstance(i, Journaled)]
            if journaled:  # not taken: forget them, or the retry would look like a duplicate and be dropped
                self.store.inbox_forget(journaled)

            raise Overloaded("the agent's queue is full; retry later")  # counted by the server
        if batch.steps:
            self.core.state.count("records", ("step",), len(batch.steps))
        if batch.incidents:
            self.core.state.count("records", ("incident",), len(batch.incidents))

    def _journal(self, batch: Any, kept: list[tuple[int, Any]]) -> list[Any]:
        from gradloc.store.incident_json import incident_to_json

        c = batch.client
        try:
            new = self.store.inbox_put(c.client_id, batch.sequence, (c.job, c.rank, c.world_size),
                                       [(i, incident_to_json(inc)) for i, inc in kept], owner=self.core.inbox_owner)
        except Exception as exc:
            if not self.store.unavailable(exc):
                raise  # INTERNAL: the client drops the batch (no retry loop on a poison batch)
            from gradloc.transport.server import Overloaded  # UNAVAILABLE: the client keeps it, backs off, resends

            log.warning("gradloc-agent: the incident store is unavailable; batch refused for a resend: %s", exc)
            raise Overloaded(f"the incident store is unavailable ({type(exc).__name__})") from exc
        if len(new) < len(kept):
            self.core.state.count("duplicates", ("incident",), len(kept) - len(new))
        by_pos = dict(kept)
        return [Journaled(by_pos[i], (c.client_id, batch.sequence, i)) for i in new]

    def _reject(self, reason: str) -> None:
        self.core.state.count("rejected", (reason,))

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting, let in-flight RPCs finish, drain and flush everything. Safe to call twice."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        log.info("gradloc-agent: stopping (in-flight calls get %.0f s, the queue and exporters 10 s)", grace_s)
        if self._grpc is not None:
            self._grpc.stop(grace_s).wait(grace_s + 1)
        self.core.close(timeout_s=10.0)
        if self._http is not None:
            self._http.stop()
        log.info("gradloc-agent: stopped")

    def serve_until_signal(self) -> None:
        """Block until SIGTERM/SIGINT, then shut down gracefully (main thread only)."""
        # The handler only appends to a list: no lock. An ``Event.set()`` there deadlocked the daemon once (CI,
        # 2026-11-27): the signal arrived while the main thread was inside ``Event.wait`` holding the event's
        # condition lock, and the handler, run on that same thread, waited for it forever.
        requested: list[int] = []
        if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` writes every thread's stack to stderr (a stuck stop)
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        previous = {s: signal.signal(s, lambda signum, _frame: requested.append(signum))
                    for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not requested:
                time.sleep(0.2)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.stop()
