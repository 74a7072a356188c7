"""JSON codec for :class:`~gradloc.reports.CorrelatedIncident` (the store's ``json`` column, the
daemon's ``/api/incidents/<id>`` body and each line of ``gradloc-agent incidents export``).

Encoding is :func:`gradloc.records.to_dict`: plain JSON, tuples as lists, non-finite floats as the
strings ``"nan"``/``"inf"``/``"-inf"`` (strict JSON has no literal for them). Decoding is driven by
the dataclasses' own type hints rather than a hand-written mirror of every record, so a field added
to a record is decoded without touching this module, and the result is the exact frozen tree:
tuples (not lists), floats (not ints) where a float is declared, ``None`` kept. Anything that does
not fit the declared types raises :class:`ValueError` naming the JSON path, because a silently
coerced incident would render wrong numbers later. The shape is documented in
``docs/incident-store.md``.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from gradloc.records import Incident, to_dict
from gradloc.reports import CorrelatedIncident

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def correlated_to_dict(inc: CorrelatedIncident) -> dict[str, Any]:
    """Plain-JSON form of a correlated incident (``json.dumps(..., allow_nan=False)`` accepts it)."""
    if not isinstance(inc, CorrelatedIncident):
        raise TypeError(f"expected a CorrelatedIncident, got {type(inc).__name__}")
    return to_dict(inc)


def correlated_from_dict(data: Mapping[str, Any]) -> CorrelatedIncident:
    """The :class:`CorrelatedIncident` that :func:`correlated_to_dict` turned into ``data``.

    Raises ValueError when ``data`` does not have the documented shape, or was written by a newer
    schema version than this gradloc knows.
    """
    return _decode(CorrelatedIncident, data, "$")


def record_from_dict(tp: Any, data: Any, path: str = "$") -> Any:
    """Any record type (or a ``tuple[Record, ...]``) from what :func:`gradloc.records.to_dict` made of it, checked the
    same way (a precursor finding's drivers in the store, an API row in the CLI); ValueError naming the path."""
    return _decode(tp, data, path)


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, resolved type, required) per field; cached because hint resolution is slow."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name],
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls))


def _bad(path: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"{path}: expected {expected}, got {type(value).__name__} {value!r:.60}")


def _decode(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _decode_optional(tp, value, path)
    if origin is tuple:
        return _decode_tuple(tp, value, path)
    if dataclasses.is_dataclass(tp):
        return _decode_record(tp, value, path)
    return _decode_scalar(tp, value, path)


def _decode_optional(tp: Any, value: Any, path: str) -> Any:
    args = typing.get_args(tp)
    inner = [a for a in args if a is not type(None)]
    if len(inner) != 1:  # records only use ``X | None``; anything else is a programming error
        raise TypeError(f"{path}: cannot decode the union {tp!r}")
    if value is None and len(inner) < len(args):
        return None
    return _decode(inner[0], value, path)


def _decode_tuple(tp: Any, value: Any, path: str) -> tuple[Any, ...]:
    args = typing.get_args(tp)
    if not isinstance(value, (list, tuple)):
        raise _bad(path, "a list", value)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if len(args) != len(value):
        raise _bad(path, f"a list of {len(args)}", value)
    return tuple(_decode(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))


def _decode_record(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, Mapping):
        raise _bad(path, f"an object ({cls.__name__})", value)
    known = _fields(cls)
    unknown = set(value) - {name for name, _, _ in known}
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {sorted(unknown)} for {cls.__name__}")
    kwargs = {}
    for name, tp, required in known:
        if name in value:
            kwargs[name] = _decode(tp, value[name], f"{path}.{name}")
        elif required:
            raise ValueError(f"{path}: missing field {name!r} of {cls.__name__}")
    _check_version(cls, kwargs, path)
    return cls(**kwargs)


def _check_version(cls: type, kwargs: dict[str, Any], path: str) -> None:
    """A record's ``schema_version`` default is the newest version this code reads."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if "schema_version" not in fields or "schema_version" not in kwargs:
        return
    newest = fields["schema_version"].default
    if kwargs["schema_version"] > newest:
        raise ValueError(f"{path}: {cls.__name__} schema version {kwargs['schema_version']} is newer than "
                         f"{newest}, the newest this gradloc reads; upgrade gradloc")


def _decode_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is float:
        if isinstance(value, str) and value in _NONFINITE:
            return _NONFINITE[value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _bad(path, 'a number or "nan"/"inf"/"-inf"', value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _bad(path, "true/false", value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _bad(path, "an integer", value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _bad(path, "a string", value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):  # records' StrEnums (Status, Method, Level)
        try:
            return tp(value)
        except ValueError:
            raise _bad(path, f"one of {[e.value for e in tp]}", value) from None
    raise TypeError(f"{path}: no JSON decoding for {tp!r}")


def incident_to_json(inc: Incident) -> str:
    """One rank's :class:`~gradloc.records.Incident` as JSON text (the store's inbox payload)."""
    import json

    return json.dumps(to_dict(inc), allow_nan=False, ensure_ascii=False)


def incident_from_json(text: str) -> Incident:
    """The :class:`~gradloc.records.Incident` :func:`incident_to_json` wrote (ValueError if not one)."""
    import json

    return _decode(Incident, json.loads(text), "$")
