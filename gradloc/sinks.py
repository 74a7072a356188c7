"""Where a monitor's records go: the :class:`Sink` protocol and the sinks ``watch()`` adds itself.

This is the seam between the trainer side (engine, collector, detector, localizer) and
everything that makes records visible (the JSONL file, the embedded agent, the client of a
``gradloc-agent`` daemon). The engine imports only this module; the agent package and the
transport are imported here, lazily, when a sink of theirs is actually built — so the training
side never depends on the agent side.

Every sink has ``on_step / on_incident / force_flush / shutdown`` (opentelemetry-python's shape)
and never raises into training: the monitor counts a sink's failures and carries on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gradloc.config import WatchConfig
    from gradloc.records import Incident, StepRecord


class Sink(Protocol):
    def on_step(self, record: "StepRecord") -> None: ...

    def on_incident(self, incident: "Incident") -> None: ...

    def force_flush(self) -> None: ...

    def shutdown(self) -> None: ...


def default_sinks(cfg: "WatchConfig", embedded_store: bool = True) -> list[Any]:
    """The sinks ``watch`` adds on its own: JSONL (if asked), then the agent client (``agent=``)
    or the embedded agent. Nothing half-built stays open when one of them fails.

    ``embedded_store=False`` (ranks other than 0 of a DDP/FSDP2 job in embedded mode): no SQLite
    store and no ``/metrics`` server on this rank — rank 0 holds the job's incidents, and one port
    cannot serve several ranks of one node. Use a ``gradloc-agent`` daemon for every rank's metrics."""
    sinks: list[Any] = []
    try:
        if cfg.incident_path:
            from gradloc.exporters.jsonl import JsonlSink

            sinks.append(JsonlSink(cfg.incident_path))
        if cfg.agent:
            import os

            from gradloc.transport.client import AgentClient

            token = cfg.agent_token or os.environ.get("GRADLOC_AGENT_AUTH_TOKEN") or None
            sinks.append(AgentClient(cfg.agent, job=cfg.job, rank=cfg.rank, world_size=cfg.world_size, token=token,
                                     tls_ca=cfg.agent_tls_ca))
        elif cfg.embedded:
            from gradloc.agent.core import CoreConfig
            from gradloc.agent.embedded import EmbeddedAgent
            from gradloc.agent.quarantine_policy import QuarantinePolicy

            policy = QuarantinePolicy(culprits=cfg.quarantine_culprits, outlier_z=cfg.quarantine_outlier_z or None)
            sinks.append(EmbeddedAgent(job=cfg.job, rank=cfg.rank, world_size=cfg.world_size,
                                       store=cfg.store and embedded_store, store_path=cfg.store_path,
                                       metrics_address=cfg.metrics_address if embedded_store else None,
                                       otlp_endpoint=cfg.otlp_endpoint, core_config=CoreConfig(quarantine=policy)))
    except BaseException:
        for sink in sinks:
            sink.shutdown()
        raise
    return sinks
