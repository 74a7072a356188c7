"""Embedded mode: the agent's pipeline inside the training process, and the sink wiring of ``watch``.

``watch(...)`` without an agent address runs an :class:`EmbeddedAgent`: the same core as the daemon
(telemetry state, correlator, SQLite store, optional OTLP exporter, optional ``/metrics`` + API
server on a port the user chooses) on a background thread. With ``agent="host:port"`` the records
go to a :class:`~gradloc.transport.client.AgentClient` instead. Either way the training thread only
enqueues: a full queue is a counted drop, never a wait.
"""
from __future__ import annotations

import logging

from gradloc.agent.core import AgentCore, CoreConfig, Declare
from gradloc.errors import AttachError
from gradloc.records import Incident, StepRecord

log = logging.getLogger(__name__)


class EmbeddedAgent:
    """A Sink running the agent core in-process (see module docstring)."""

    def __init__(self, *, job: str, rank: int = 0, world_size: int = 1, store: bool = True,
                 store_path: str | None = None, metrics_address: str | None = None,
                 otlp_endpoint: str | None = None, core_config: CoreConfig | None = None) -> None:
        from gradloc.store.sqlite import IncidentStore, default_db_path

        self.store_path = (store_path or str(default_db_path())) if store else None
        self.core = AgentCore(core_config, IncidentStore(self.store_path) if self.store_path else None)
        if otlp_endpoint:
            from gradloc.exporters.otlp import OtlpExporter

            self.core.exporters.append(OtlpExporter(self.core.state, otlp_endpoint))
        self.core.start()
        self.core.submit([Declare(job, rank, world_size)])
        self.http = None
        if metrics_address:
            from gradloc.agent.http import AgentHttpServer

            try:
                self.http = AgentHttpServer(self.core, metrics_address).start()
            except (OSError, ValueError) as exc:
                self.core.close()
                raise AttachError(f"gradloc: cannot serve /metrics on {metrics_address}: {exc}") from exc
        self.dropped = 0

    @property
    def metrics_url(self) -> str | None:
        return None if self.http is None else "http://%s:%d/metrics" % self.http.address

    def _submit(self, item: StepRecord | Incident) -> None:
        if not self.core.submit([item]):
            self.dropped += 1
            self.core.state.count("export_dropped", ("embedded_queue",))

    def on_step(self, record: StepRecord) -> None:
        self._submit(record)

    def on_incident(self, incident: Incident) -> None:
        self._submit(incident)

    def force_flush(self) -> None:
        self.core.flush(10.0)

    def shutdown(self) -> None:
        self.core.close()
        if self.http is not None:
            self.http.stop()
            self.http = None
