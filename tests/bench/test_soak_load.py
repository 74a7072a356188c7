"""The soak's replay generator sends what the real encoder would: same decoded message, same record."""
from __future__ import annotations

import time
from dataclasses import fields, is_dataclass, replace

import numpy as np
import pytest

from bench.agent import template
from bench.soak_load import restamp
from gradloc.transport.codec import LayerTables, decode_step, encode_step
from gradloc.transport.wire import pb


def _real(rec, tables: LayerTables) -> tuple[bytes, tuple[str, ...]]:
    names = tuple(s.layer for s in rec.layers)
    table_id, index = tables.lookup(names)
    return encode_step(rec, table_id, index, rec.job, rec.rank).SerializeToString(), names


@pytest.mark.parametrize("step", [0, 1, 127, 128, 10**6, 2**62])
def test_replay_bytes_decode_like_the_real_encoder(step):
    tables = LayerTables()
    first = replace(template(32, 8, 1), step=5, time_unix=1.0)
    body = pb.Step.FromString(_real(first, tables)[0])
    body.ClearField("step")
    body.ClearField("time_unix")
    t = time.time()
    want, names = _real(replace(first, step=step, time_unix=t), tables)
    got = restamp(body.SerializeToString(), step, t)
    assert got != want  # different bytes (fields appended), ...
    assert pb.Step.FromString(got) == pb.Step.FromString(want)  # ... the same message
    a, b = (decode_step(pb.Step.FromString(x), names, "bench", 1, 2, "s", True) for x in (got, want))
    assert a.step == step and a.time_unix == t
    for f in fields(a):
        assert _same(getattr(a, f.name), getattr(b, f.name)), f.name


def _same(x, y) -> bool:
    if is_dataclass(x):
        return all(_same(getattr(x, f.name), getattr(y, f.name)) for f in fields(x))
    if isinstance(x, np.ndarray):
        return np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
    return x == y


def test_restamp_overrides_values_already_in_the_body():
    """A body that still carries a step and time (not cleared) decodes with the restamped ones."""
    tables = LayerTables()
    raw, _ = _real(replace(template(4, 2, 0), step=99, time_unix=2.0), tables)
    m = pb.Step.FromString(restamp(raw, 7, 3.5))
    assert (m.step, m.time_unix) == (7, 3.5)
