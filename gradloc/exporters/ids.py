"""Trace and span ids from ``os.urandom``, and a way to give an incident's trace a chosen id.

Why not the SDK default: ``RandomIdGenerator`` draws from the module-level :mod:`random`, which
training scripts seed for reproducibility (``random.seed(42)``) — every run and every rank would then
produce the same trace ids and their traces would merge in the backend. Ids here come from
``os.urandom`` and are unaffected by any seeding.

Why a forced id: the correlator assigns an incident's ``trace_id`` (with :func:`new_trace_id`) long
before the OTLP exporter builds the trace, and the store, the JSON incident and the metric
exemplars all carry that id. The exporter must emit a trace with exactly that id and a *root* span
(no fake parent), so the id generator hands out a caller-chosen trace id once, inside
:func:`forced_trace_id`::

    with forced_trace_id(inc.trace_id):
        root = tracer.start_span("gradloc.incident")   # root.context.trace_id == int(inc.trace_id, 16)

The override is thread-local and consumed by the first ``generate_trace_id`` call, so spans started
by other threads (or a second root in the same block) get fresh random ids.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from opentelemetry.sdk.trace.id_generator import IdGenerator

_local = threading.local()


def _nonzero_bits(nbytes: int) -> int:
    while True:  # an all-zero id is invalid in OTel; 2^-64 odds, but loop rather than hope
        value = int.from_bytes(os.urandom(nbytes), "big")
        if value:
            return value


def new_trace_id() -> str:
    """A fresh trace id: 32 lowercase hex digits, never all zeros, from ``os.urandom``."""
    return f"{_nonzero_bits(16):032x}"


def new_span_id() -> str:
    """A fresh span id: 16 lowercase hex digits, never all zeros, from ``os.urandom``."""
    return f"{_nonzero_bits(8):016x}"


def parse_trace_id(trace_id: str) -> int:
    """The integer form of a 32-hex-digit trace id; ``ValueError`` if it is not one (or all zeros)."""
    if not isinstance(trace_id, str) or len(trace_id) != 32:
        raise ValueError(f"trace id must be 32 hex digits, got {trace_id!r}")
    try:
        value = int(trace_id, 16)
    except ValueError:
        raise ValueError(f"trace id must be 32 hex digits, got {trace_id!r}") from None
    if value == 0:
        raise ValueError("trace id must not be all zeros")
    return value


@contextlib.contextmanager
def forced_trace_id(trace_id: str) -> Iterator[None]:
    """Make the next root span started on this thread (inside the block) use ``trace_id``."""
    value = parse_trace_id(trace_id)
    previous = getattr(_local, "trace_id", None)
    _local.trace_id = value
    try:
        yield
    finally:
        _local.trace_id = previous


class GradlocIdGenerator(IdGenerator):
    """OTel ``IdGenerator`` drawing from ``os.urandom``, honouring :func:`forced_trace_id`."""

    def generate_span_id(self) -> int:
        return _nonzero_bits(8)

    def generate_trace_id(self) -> int:
        forced = getattr(_local, "trace_id", None)
        if forced is not None:
            _local.trace_id = None  # consumed: one forced id → one trace
            return forced
        return _nonzero_bits(16)

    def is_trace_id_random(self) -> bool:
        # Forced ids come from new_trace_id() (os.urandom) upstream, so they are random too.
        return True
