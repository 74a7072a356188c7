"""The daemon's gRPC ingest endpoint: raw bytes in, validated :class:`DecodedBatch` to a handler.

The method is registered with an identity request deserializer so this module sees the request
bytes itself: it measures them (its own size limit, counted, instead of grpc's silent one — grpc's
receive limit is set well above it), parses them, validates them all-or-nothing, and answers every
rejection with a status code the client acts on:

* ``INVALID_ARGUMENT`` — malformed or invalid batch (the client drops it and counts ``rejected``);
* ``RESOURCE_EXHAUSTED`` — larger than ``max_message_bytes``;
* ``FAILED_PRECONDITION`` — a layer table id unknown here (daemon restarted, or the table aged out
  of the cache): the client resends the batch with its tables;
* ``UNAVAILABLE`` — the handler raised :class:`Overloaded` (reason ``"overloaded"``): the
  client keeps the batch and retries after its backoff (backpressure instead of loss);
* ``UNAUTHENTICATED`` — the daemon has an auth token and the call's ``authorization`` metadata does
  not carry it (reason ``"unauthenticated"``; the client drops the batch and counts ``rejected``);
* ``INTERNAL`` — the handler raised anything else (reason ``"internal"``); the server keeps serving.

Every rejection calls ``on_reject(reason)`` first, so the daemon can count it by reason
(:data:`ON_REJECT_REASONS`: the validation reasons plus ``"overloaded"`` and ``"internal"``).
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NoReturn

import grpc

from gradloc.transport.codec import BatchDecoder, DecodedBatch
from gradloc.transport.validate import REASONS, RejectedBatch
from gradloc.transport.wire import MAX_MESSAGE_BYTES, SERVICE, pb

log = logging.getLogger(__name__)
ON_REJECT_REASONS = REASONS | {"overloaded", "internal", "unauthenticated"}


class Overloaded(Exception):
    """Raise from the handler when the batch cannot be taken now (e.g. the daemon's queue is full):
    the client gets UNAVAILABLE and resends the batch after its backoff."""

_CODES = {"oversized": grpc.StatusCode.RESOURCE_EXHAUSTED,
          "unknown_layer_table": grpc.StatusCode.FAILED_PRECONDITION}
_GRPC_HEADROOM = 2  # grpc's own receive limit = this × ours (+1 MiB): our check fires, and counts


def start_ingest_server(handler: Callable[[DecodedBatch], None], on_reject: Callable[[str], None] | None = None, *,
                        address: str = "127.0.0.1:0", max_message_bytes: int = MAX_MESSAGE_BYTES,
                        workers: int = 4, decoder: BatchDecoder | None = None,
                        security: Any = None) -> tuple[grpc.Server, int]:
    """Start serving ``gradloc.v1.IngestService`` on ``address``; returns (server, bound port).

    ``handler`` receives each accepted batch (it runs on one of ``workers`` threads, so it must be
    thread-safe); stop with ``server.stop(grace)``.
    """
    decoder = decoder if decoder is not None else BatchDecoder(max_message_bytes=max_message_bytes)
    ingest = _IngestMethod(decoder, handler, on_reject or (lambda reason: None), security)
    limit = _GRPC_HEADROOM * max_message_bytes + (1 << 20)
    server = grpc.server(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gradloc-ingest"),
                         options=[("grpc.max_receive_message_length", limit),
                                  ("grpc.max_send_message_length", 1 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Ingest": grpc.unary_unary_rpc_method_handler(ingest),  # no (de)serializers: raw bytes
    }),))
    if security is not None and security.tls:
        port = server.add_secure_port(address, security.grpc_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"gradloc ingest server could not bind {address!r}")
    server.start()
    return server, port


class _IngestMethod:
    def __init__(self, decoder: BatchDecoder, handler: Callable[[DecodedBatch], None],
                 on_reject: Callable[[str], None], security: Any = None) -> None:
        self.decoder, self.handler, self.on_reject, self.security = decoder, handler, on_reject, security

    def __call__(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        if self.security is not None and self.security.token:
            given = dict(context.invocation_metadata()).get("authorization")
            if not self.security.allows(given):
                self._abort(context, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong bearer token (authorization metadata)")
        try:
            batch = self.decoder.decode(request)
        except RejectedBatch as exc:
            self._abort(context, exc.reason, _CODES.get(exc.reason, grpc.StatusCode.INVALID_ARGUMENT), str(exc))
        except Exception as exc:  # a decoder bug must not take the daemon down
            log.exception("gradloc: decoding a batch failed")
            self._abort(context, "internal", grpc.StatusCode.INTERNAL, f"internal: decoding failed: {exc!r}")
        try:
            self.handler(batch)
        except Overloaded as exc:
            self._abort(context, "overloaded", grpc.StatusCode.UNAVAILABLE, f"overloaded: {exc}")
        except Exception as exc:
            log.exception("gradloc: the ingest handler failed")
            self._abort(context, "internal", grpc.StatusCode.INTERNAL, f"internal: handler failed: {exc!r}")
        reply = pb.IngestReply(accepted_steps=len(batch.steps), accepted_incidents=len(batch.incidents))
        return reply.SerializeToString()

    def _abort(self, context: grpc.ServicerContext, reason: str, code: grpc.StatusCode, message: str) -> NoReturn:
        try:
            self.on_reject(reason)
        except Exception:
            log.exception("gradloc: on_reject(%r) failed", reason)
        if reason not in ("internal", "overloaded"):
            log.info("gradloc: rejected a batch from %s: %s", context.peer(), message)
        context.abort(code, message)
