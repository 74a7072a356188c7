"""Embedded mode: the agent's pipeline inside the training process, and the sink wiring of ``watch``.

``watch(...)`` without an agent address runs an :class:`EmbeddedAgent`: the same core as the daemon
(telemetry state, correlator, SQLite store, optional OTLP exporter, optional ``/metrics`` + API
server on a port the user chooses) on a background thread. With ``agent="host:port"`` the records
go to a :class:`~gradloc.transport.client.AgentClient` instead. Either way the training thread only
enqueues: a full queue is a counted drop, never a wait.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid

from gradloc.agent.core import AgentCore, CoreConfig, Declare, Journaled
from gradloc.errors import AttachError
from gradloc.records import Incident, StepRecord

log = logging.getLogger(__name__)
EMBEDDED_PREFIX = "embedded:"


def _gone(owner: str) -> bool:
    """Whether the process of an ``embedded:<host>:<pid>:<id>`` owner (on this host) has exited."""
    try:
        pid = int(owner.split(":")[2])
    except (IndexError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, someone else's
        return False
    return False


class EmbeddedAgent:
    """A Sink running the agent core in-process (see module docstring)."""

    def __init__(self, *, job: str, rank: int = 0, world_size: int = 1, store: bool = True,
                 store_path: str | None = None, metrics_address: str | None = None,
                 otlp_endpoint: str | None = None, core_config: CoreConfig | None = None) -> None:
        from gradloc.store.sqlite import IncidentStore, default_db_path

        self.store_path = (store_path or str(default_db_path())) if store else None
        self.world_size = world_size
        self.owner = f"{EMBEDDED_PREFIX}{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self._seq = 0
        self.core = AgentCore(core_config, IncidentStore(self.store_path) if self.store_path else None,
                              inbox_owner=self.owner)
        self._claim_orphans()
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

    def _submit(self, item: StepRecord | Incident | Journaled) -> None:
        if not self.core.submit([item]):
            self.dropped += 1
            self.core.state.count("export_dropped", ("embedded_queue",))

    def on_step(self, record: StepRecord) -> None:
        self._submit(record)

    def on_incident(self, incident: Incident) -> None:
        """Commit the incident to the store's inbox before returning (a killed training process
        loses no incident it reported: the next embedded agent on this host stores it), then queue it."""
        self._submit(self._journal(incident) if self.core.store is not None else incident)

    def _journal(self, incident: Incident) -> Incident | Journaled:
        from gradloc.store.incident_json import incident_to_json

        self._seq += 1
        try:
            self.core.store.inbox_put(self.owner, self._seq, (incident.job, incident.rank, self.world_size),
                                      [(0, incident_to_json(incident))], owner=self.owner)
        except Exception:  # noqa: BLE001 - never raise into training: counted, queued without the journal
            log.warning("gradloc: could not journal incident %s", incident.incident_id, exc_info=True)
            self.core.state.count("export_failures", ("store",))
            return incident
        return Journaled(incident, (self.owner, self._seq, 0))

    def _claim_orphans(self) -> None:
        """Take over the open inbox rows of embedded agents on this host whose process is gone."""
        if self.core.store is None:
            return
        try:
            n = self.core.store.inbox_claim(self.owner, f"{EMBEDDED_PREFIX}{socket.gethostname()}:", _gone)
        except Exception:  # noqa: BLE001 - the monitor still starts
            log.warning("gradloc: could not read the incident store's inbox", exc_info=True)
            return
        if n:
            log.warning("gradloc: %d incident(s) a killed training process reported are stored now", n)

    def force_flush(self) -> None:
        self.core.flush(10.0)

    def shutdown(self) -> None:
        self.core.close()
        if self.http is not None:
            self.http.stop()
            self.http = None
