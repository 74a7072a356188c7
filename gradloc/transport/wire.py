"""Constants of the wire protocol and the content address of a layer table.

Both ends use the method path directly (``channel.unary_unary`` / a generic handler) instead of
the generated ``*_pb2_grpc`` stubs: the server must see the raw request bytes to measure and
parse them itself, and neither end then depends on the grpcio version that generated the stubs.
"""
from __future__ import annotations

import hashlib

from gradloc.transport._generated.gradloc.v1 import gradloc_pb2 as pb

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)
SERVICE = "gradloc.v1.IngestService"
INGEST_METHOD = f"/{SERVICE}/Ingest"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def layer_table_id(names: tuple[str, ...]) -> int:
    """Stable 64-bit id of a names tuple: blake2b of the table's canonical protobuf encoding
    (length-prefixed strings, so no two different tuples share an encoding)."""
    data = pb.LayerTable(names=names).SerializeToString(deterministic=True)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


__all__ = ["pb", "SCHEMA_VERSION", "SUPPORTED_SCHEMA_VERSIONS", "SERVICE", "INGEST_METHOD",
           "MAX_MESSAGE_BYTES", "layer_table_id"]
