"""A protobuf wire-format tree for the fuzz test: parse bytes into fields, mutate, serialize again.

Lengths are recomputed on serialization, so a mutation deep inside a message (a varint made
longer, a field repeated 5,000 times) still yields a message whose framing is right and whose
*content* is the problem — the parser gets past the framing and the daemon's validation is tested.
``raw`` overrides the encoding of a varint value (wire type 0) or of a length prefix (wire type 2)
to produce overlong, over-64-bit or beyond-the-buffer encodings on purpose.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Union

from gradloc.transport.codec import _varint  # the encoder's own

Value = Union[int, bytes, list["Field"]]


@dataclass(frozen=True)
class Field:
    number: int
    wire_type: int  # 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32 (3, 4, 6, 7 only as mutations)
    value: Value  # int (0), 8/4 bytes (1/5), sub-message fields or bytes (2)
    raw: bytes | None = None  # the varint / length prefix as encoded, when not the minimal encoding


def varint(n: int) -> bytes:
    """The protobuf varint of ``n`` as uint64 (a negative int64 wraps, as protobuf encodes it)."""
    return _varint(n & ((1 << 64) - 1))


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("bad varint")
        b = data[pos]
        n |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not b & 0x80:
            return n, pos


def parse(data: bytes, depth: int = 0) -> list[Field]:
    """The fields of one message; a length-delimited payload that parses (and re-serializes to the
    same bytes) becomes a sub-tree, anything else stays bytes. ValueError if ``data`` is not wire format."""
    out, pos = [], 0
    while pos < len(data):
        tag, pos = _read_varint(data, pos)
        number, wt = tag >> 3, tag & 7
        if number == 0:
            raise ValueError("field number 0")
        if wt == 0:
            value, pos = _read_varint(data, pos)
        elif wt in (1, 5):
            size = 8 if wt == 1 else 4
            value, pos = data[pos:pos + size], pos + size
            if len(value) != size:
                raise ValueError("truncated fixed field")
        elif wt == 2:
            size, pos = _read_varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
            if len(value) != size:
                raise ValueError("truncated length-delimited field")
            value = _maybe_tree(value, depth)
        else:
            raise ValueError(f"wire type {wt}")
        out.append(Field(number, wt, value))
    return out


def _maybe_tree(payload: bytes, depth: int) -> Value:
    if not payload or depth >= 8:
        return payload
    try:
        tree = parse(payload, depth + 1)
    except ValueError:
        return payload
    return tree if serialize(tree) == payload else payload


def serialize(fields: list[Field]) -> bytes:
    parts = []
    for f in fields:
        parts.append(varint(f.number << 3 | f.wire_type))
        if isinstance(f.value, int):
            parts.append(f.raw if f.raw is not None else varint(f.value))
            continue
        payload = serialize(f.value) if isinstance(f.value, list) else f.value
        if isinstance(f.value, list) or f.wire_type == 2:
            parts.append(f.raw if f.raw is not None else varint(len(payload)))
        parts.append(payload)
    return b"".join(parts)


def blow_up_varint(f: Field, rng: random.Random) -> Field:
    """A varint value made extreme, or its encoding (or a length prefix) overlong or out of range."""
    if isinstance(f.value, int):
        choice = rng.randrange(5)
        if choice == 0:
            return replace(f, value=rng.choice((2 ** 64 - 1, 2 ** 63, 2 ** 63 - 1, 2 ** 32, 2 ** 31, 1 << 56)))
        if choice == 1:  # overlong but valid: the same value padded to 10 bytes
            raw = bytearray(varint(f.value).ljust(10, b"\x00"))
            for k in range(9):
                raw[k] |= 0x80
            return replace(f, raw=bytes(raw))
        if choice == 2:  # 11 bytes: longer than any 64-bit varint
            return replace(f, raw=b"\xff" * 10 + b"\x01")
        if choice == 3:  # 10th byte carries bits beyond 64
            return replace(f, raw=b"\xff" * 9 + b"\x7f")
        return replace(f, raw=b"\x80" * rng.randint(1, 9))  # never terminated (runs into the next field)
    if f.wire_type != 2:
        return f
    size = len(serialize(f.value)) if isinstance(f.value, list) else len(f.value)
    raw = rng.choice((varint(size + 1), varint(max(size - 1, 0)), varint(2 ** 31), varint(2 ** 64 - 1),
                      varint(2 ** 32 + size), bytes([0x80 | (size & 0x7F)]) + b"\x80" * 3 + bytes([size >> 7])))
    return replace(f, raw=raw)
