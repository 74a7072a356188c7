"""Transport between a training process and the ``gradloc-agent`` daemon (gRPC, protobuf ``gradloc.v1``).

Trainer side: :class:`AgentClient`, a sink (``on_step/on_incident/force_flush/shutdown``) that only
enqueues on the training thread; a background thread batches, encodes and sends. Daemon side:
:func:`start_ingest_server` parses and validates every batch (:class:`BatchDecoder`) and hands a
:class:`DecodedBatch` of agent-side records to its handler, or counts a :class:`RejectedBatch`.
The schema lives in ``proto/gradloc/v1/gradloc.proto``; generated code in ``_generated/``.
"""
from gradloc.transport.client import AgentClient
from gradloc.transport.client_config import ClientConfig
from gradloc.transport.codec import BatchDecoder, ClientDrops, ClientInfo, DecodedBatch, LayerTableCache
from gradloc.transport.server import ON_REJECT_REASONS, Overloaded, start_ingest_server
from gradloc.transport.validate import REASONS, RejectedBatch
from gradloc.transport.wire import SCHEMA_VERSION, SUPPORTED_SCHEMA_VERSIONS

__all__ = ["AgentClient", "ClientConfig", "BatchDecoder", "ClientDrops", "ClientInfo", "DecodedBatch",
           "LayerTableCache", "ON_REJECT_REASONS", "Overloaded", "start_ingest_server", "REASONS", "RejectedBatch",
           "SCHEMA_VERSION", "SUPPORTED_SCHEMA_VERSIONS"]
