"""The agent client's gRPC link to the daemon: the channel (plain or TLS, the bearer token), which layer tables the
daemon has been sent on it, and one batch's call with a deadline that shutdown can cancel
(``transport/client.py`` owns the batching, the retries and the counts)."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import grpc

from gradloc.transport.client_config import ClientConfig
from gradloc.transport.codec import batch_bytes
from gradloc.transport.wire import INGEST_METHOD, SCHEMA_VERSION, pb

RETRY = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})  # keep the batch, back off


@dataclass(slots=True)
class Item:
    data: bytes  # the serialized pb.Step / pb.IncidentMsg
    table: tuple[int, tuple[str, ...]] | None  # (id, names) for a step, None for an incident


class IngestLink:
    def __init__(self, config: ClientConfig, client_info: pb.ClientInfo, lock: threading.Condition,
                 warn: Callable[..., None]) -> None:
        self.config, self.client_info, self._cond, self._warn = config, client_info, lock, warn
        self.sent_tables: set[int] = set()  # layer tables the daemon was sent on this channel
        self._channel: Any = None
        self._call: Any = None
        self._future: grpc.Future | None = None  # the call in flight (guarded by the lock): cancel() abandons it
        self._metadata = (("authorization", f"Bearer {config.token}"),) if config.token else None

    def connect(self) -> None:
        """A fresh channel (the old one closed); a new connection may be a new daemon: tables go again."""
        if self._channel is not None:
            self._channel.close()
        options = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
        if self.config.tls or self.config.tls_ca:
            ca = open(self.config.tls_ca, "rb").read() if self.config.tls_ca else None
            self._channel = grpc.secure_channel(self.config.address, grpc.ssl_channel_credentials(ca), options)
        else:
            self._channel = grpc.insecure_channel(self.config.address, options=options)
        self._call = self._channel.unary_unary(INGEST_METHOD, request_serializer=None,
                                               response_deserializer=pb.IngestReply.FromString)
        self.sent_tables.clear()

    @property
    def in_call(self) -> bool:
        with self._cond:
            return self._future is not None

    def send(self, seq: int, items: list[Item], drops: pb.ClientDrops, timeout: float,
             stopping: bool) -> tuple[grpc.StatusCode | None, str]:
        """One attempt of batch ``seq`` (with the tables the daemon lacks); (None, "") on success, else the status
        code and details. ``stopping``: shutdown began (a cancelled call is its doing, not the daemon's)."""
        tables = {it.table[0]: it.table[1] for it in items if it.table and it.table[0] not in self.sent_tables}
        header = pb.IngestBatch(schema_version=SCHEMA_VERSION, client=self.client_info, drops=drops, sequence=seq,
                                layer_tables=[pb.LayerTable(id=i, names=n) for i, n in tables.items()])
        data = batch_bytes(header, [it.data for it in items if it.table], [it.data for it in items if not it.table])
        try:
            future = self._call.future(data, timeout=timeout, metadata=self._metadata)
            with self._cond:
                self._future = future
            try:
                future.result()
            finally:
                with self._cond:
                    self._future = None
        except grpc.FutureCancelledError:  # by shutdown, at its deadline: dropped and counted, not retried
            return grpc.StatusCode.CANCELLED, "cancelled at shutdown"
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            details = (exc.details() if hasattr(exc, "details") else None) or ""
            if code == grpc.StatusCode.CANCELLED and stopping:
                return code, "cancelled at shutdown"
            if code not in RETRY and code != grpc.StatusCode.FAILED_PRECONDITION:
                self._warn(f"status-{code}", "gradloc: the agent refused a batch of %d records: %s %s", len(items),
                           code, details)
            return code, details
        self.sent_tables.update(tables)
        return None, ""

    def cancel(self) -> None:
        """Abandon the call in flight, if any (shutdown, past its deadline)."""
        with self._cond:
            future = self._future
        if future is not None:
            future.cancel()

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


__all__ = ["IngestLink", "Item", "RETRY"]
