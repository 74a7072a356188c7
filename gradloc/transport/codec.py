"""The wire codec: trainer records → batch bytes, and batch bytes → a validated :class:`DecodedBatch`.

Decoding is **all-or-nothing**: the whole batch is parsed and validated before anything is
returned or remembered (layer tables that arrive in a batch are looked up from a batch-local
overlay first and enter the shared cache only when the batch is accepted), so a rejected batch
leaves no trace but its counted :class:`~gradloc.transport.validate.RejectedBatch`.

NaN/Inf policy (what the daemon accepts):

* ``loss`` (step and spike) may be anything: a non-finite loss is itself an event.
* Gradient measurements — a step's ``global_norm`` and its token scores/shares, a layer's
  ``grad_norm``/``grad_max_abs``/``param_norm``/``update_ratio`` — may be non-finite only when the
  step's (for a layer column: that layer's) ``nonfinite`` count is > 0. ``update_ratio`` NaN means
  "unknown" and is always accepted.
* In an incident, the spike's and localization's gradient norms and the localization's shares may
  be ±inf only in a nonfinite-gradient incident (``nonfinite_grad`` kind or a top layer with a
  nonfinite count); the localization's derived shares/norms may be NaN ("not measurable", as the
  localizer writes it); ``loss_share``/``loss_without_culprits`` are non-finite only with a
  non-finite spike loss.
* Everything else (times, grad scale, z, mean, std, loss z/mean) must be finite.

Anything else is rejected with reason ``"nonfinite"``; see :mod:`gradloc.transport.validate`.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, fields

from google.protobuf.message import DecodeError

from gradloc.records import Incident
from gradloc.reports import StepSummary
from gradloc.transport import validate as v
from gradloc.transport.codec_incidents import encode_incident
from gradloc.transport.codec_steps import decode_step, encode_step
from gradloc.transport.decode_incidents import decode_incident
from gradloc.transport.wire import MAX_MESSAGE_BYTES, SUPPORTED_SCHEMA_VERSIONS, layer_table_id, pb

__all__ = ["ClientInfo", "ClientDrops", "DecodedBatch", "LayerTableCache", "BatchDecoder", "LayerTables",
           "encode_step", "encode_incident", "decode_step", "decode_incident", "batch_bytes", "field_bytes",
           "check_table"]


@dataclass(frozen=True)
class ClientInfo:
    job: str
    rank: int
    world_size: int
    client_id: str
    hostname: str
    pid: int
    gradloc_version: str


@dataclass(frozen=True)
class ClientDrops:
    """Cumulative drop counters of one client (since it started)."""

    queue_full: int = 0
    send_failed: int = 0
    encode_failed: int = 0
    rejected: int = 0

    def items(self) -> tuple[tuple[str, int], ...]:
        """(counter, value) pairs, in field order."""
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))


@dataclass(frozen=True)
class DecodedBatch:
    client: ClientInfo
    drops: ClientDrops
    steps: tuple[StepSummary, ...]
    incidents: tuple[Incident, ...]
    sequence: int = 0  # the client's batch number; a resent batch repeats it


# -- daemon side ---------------------------------------------------------------------------------
class LayerTableCache:
    """Bounded LRU of layer tables by (content-addressed) id, shared by all clients; thread-safe."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._tables: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, ids: set[int]) -> dict[int, tuple[str, ...]]:
        """The known tables among ``ids`` (no LRU update: the batch may still be rejected)."""
        with self._lock:
            return {i: self._tables[i] for i in ids if i in self._tables}

    def commit(self, new: dict[int, tuple[str, ...]], used: set[int]) -> None:
        with self._lock:
            self._tables.update(new)
            for i in (*new, *used):
                if i in self._tables:
                    self._tables.move_to_end(i)
            while len(self._tables) > self.capacity:
                self._tables.popitem(last=False)

    def __len__(self) -> int:
        return len(self._tables)


class BatchDecoder:
    """Bytes → :class:`DecodedBatch`, or :class:`RejectedBatch` with nothing applied."""

    def __init__(self, cache: LayerTableCache | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 keep_top_tokens: bool = True) -> None:
        self.cache = cache if cache is not None else LayerTableCache()
        self.max_message_bytes = max_message_bytes
        self.keep_top_tokens = keep_top_tokens  # False: validated, not kept (see decode_step)

    def decode(self, data: bytes) -> DecodedBatch:
        if len(data) > self.max_message_bytes:
            raise v.reject("oversized", f"batch is {len(data)} bytes, more than the {self.max_message_bytes} "
                                        "this daemon accepts (send smaller batches)")
        try:
            msg = pb.IngestBatch.FromString(data)
        except DecodeError as exc:
            raise v.reject("malformed", f"batch is not a gradloc.v1.IngestBatch: {exc}") from None
        return self.decode_message(msg)

    def decode_message(self, msg: pb.IngestBatch) -> DecodedBatch:
        if msg.schema_version not in SUPPORTED_SCHEMA_VERSIONS:
            raise v.reject("schema_version", f"schema_version {msg.schema_version} is not supported; this daemon "
                                             f"speaks {list(SUPPORTED_SCHEMA_VERSIONS)}")
        client = _client(msg)
        if msg.sequence > v.MAX_INT64:  # the store keys its inbox by it (SQLite INTEGER: 64-bit signed)
            raise v.reject("invalid_value", f"sequence is {msg.sequence} (must be < 2**63)")
        new = _tables(msg)
        ids = {m.layer_table_id for m in msg.steps}
        known = {**self.cache.lookup(ids - new.keys()), **new}
        steps = tuple(decode_step(m, _table(known, m.layer_table_id, i), client.job, client.rank, client.world_size,
                                  f"steps[{i}]", self.keep_top_tokens) for i, m in enumerate(msg.steps))
        incidents = tuple(decode_incident(m, client.world_size, f"incidents[{i}]") for i, m in enumerate(msg.incidents))
        d = msg.drops
        drops = ClientDrops(d.queue_full, d.send_failed, d.encode_failed, d.rejected)
        self.cache.commit(new, ids)
        return DecodedBatch(client, drops, steps, incidents, msg.sequence)


def _client(msg: pb.IngestBatch) -> ClientInfo:
    if not msg.HasField("client"):
        raise v.reject("invalid_value", "client is missing")
    c = msg.client
    if not 1 <= c.world_size <= v.MAX_WORLD_SIZE:
        raise v.reject("invalid_value", f"client.world_size is {c.world_size} (must be in 1..{v.MAX_WORLD_SIZE})")
    return ClientInfo(v.text(c.job, "client.job", required=True), v.rank(c.rank, c.world_size, "client.rank"),
                      c.world_size, v.text(c.client_id, "client.client_id", required=True),
                      v.text(c.hostname, "client.hostname"), v.count(c.pid, "client.pid"),
                      v.text(c.gradloc_version, "client.gradloc_version"))


def _tables(msg: pb.IngestBatch) -> dict[int, tuple[str, ...]]:
    out: dict[int, tuple[str, ...]] = {}
    for i, t in enumerate(msg.layer_tables):
        where = f"layer_tables[{i}]"
        names = check_table(tuple(t.names), where)
        if layer_table_id(names) != t.id:
            raise v.reject("invalid_value", f"{where}.id {t.id:#018x} is not the id of its names "
                                            f"({layer_table_id(names):#018x}; see gradloc.transport.wire)")
        out[t.id] = names
    return out


def check_table(names: tuple[str, ...], where: str) -> tuple[str, ...]:
    if len(names) > v.MAX_LAYERS:
        raise v.reject("invalid_value", f"{where} has {len(names)} layers (at most {v.MAX_LAYERS})")
    for j, name in enumerate(names):
        v.text(name, f"{where}.names[{j}]", required=True)
    return names


def _table(known: dict[int, tuple[str, ...]], table_id: int, i: int) -> tuple[str, ...]:
    names = known.get(table_id)
    if names is None:
        raise v.reject("unknown_layer_table", f"steps[{i}].layer_table_id {table_id:#018x} is not known here (the "
                                              "daemon may have restarted): resend the batch with its layer tables")
    return names


# -- trainer side --------------------------------------------------------------------------------
class LayerTables:
    """Names tuple → (table id, name → index), remembered for the last ``capacity`` distinct tuples
    (the set of layers with a gradient can differ between steps, e.g. frozen or unused layers)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._by_names: OrderedDict[tuple[str, ...], tuple[int, dict[str, int]]] = OrderedDict()

    def lookup(self, names: tuple[str, ...]) -> tuple[int, dict[str, int]]:
        """Raises :class:`RejectedBatch` for a table the daemon would refuse (checked once per table)."""
        hit = self._by_names.get(names)
        if hit is None:
            check_table(names, "layer table")
            hit = self._by_names[names] = (layer_table_id(names), {n: i for i, n in enumerate(names)})
            if len(self._by_names) > self.capacity:
                self._by_names.popitem(last=False)
        else:
            self._by_names.move_to_end(names)
        return hit


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def field_bytes(field_number: int, payload: bytes) -> bytes:
    """One length-delimited field (a sub-message) in protobuf wire format."""
    return _varint(field_number << 3 | 2) + _varint(len(payload)) + payload


_STEPS = pb.IngestBatch.DESCRIPTOR.fields_by_name["steps"].number
_INCIDENTS = pb.IngestBatch.DESCRIPTOR.fields_by_name["incidents"].number


def batch_bytes(header: pb.IngestBatch, steps: list[bytes], incidents: list[bytes]) -> bytes:
    """An IngestBatch from its header (client, drops, tables, sequence) and already serialized steps
    and incidents: protobuf fields may come in any order, so concatenation is a valid encoding and
    each record is serialized once, however often its batch is resent."""
    parts = [header.SerializeToString()]
    parts += [field_bytes(_STEPS, s) for s in steps]
    parts += [field_bytes(_INCIDENTS, s) for s in incidents]
    return b"".join(parts)
