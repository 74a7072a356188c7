"""Validation of what arrives on the wire: one exception type, a fixed set of reasons, limits.

The daemon serves many trainers; one bad client must not poison what it stores or exports, and a
rejection must say exactly what was wrong (field and index) so the trainer's owner can fix it.
``RejectedBatch.reason`` is one of :data:`REASONS` so it can be a metric label (bounded
cardinality); the message is for humans and logs.

NaN/Inf policy (the checks below implement it; docs in :mod:`gradloc.transport.codec`):
a non-finite *gradient measurement* is data (a nonfinite-gradient event the daemon must report),
but only when the record says so with a nonfinite count > 0 — except +inf gradient norms, which
are always accepted (an overflowed float32 norm of finite elements); anywhere else a non-finite
float is a client bug and the batch is rejected with reason ``"nonfinite"``.
"""
from __future__ import annotations

import math

import numpy as np

REASONS = frozenset({"malformed", "oversized", "schema_version", "nonfinite", "length_mismatch",
                     "unknown_layer_table", "invalid_value"})
MAX_LAYERS = 65_536  # layer groups per table
MAX_NAME = 1_024  # characters in an identifier: job, layer, kind, sample id, hostname …
MAX_TEXT = 65_536  # characters in free text: decoded token text, notes, details
# Ranks in a job. The correlator expects range(world_size) for every incident of the job and lists
# the missing ones in it, so an unbounded world size (any int64 passed before) made the daemon's
# worker allocate without bound (MemoryError, or the host's memory) and lose the job's incidents.
MAX_WORLD_SIZE = 65_536
MAX_INT64 = 2**63 - 1  # uint64 wire fields stored in SQLite INTEGER columns (the batch sequence)


class RejectedBatch(ValueError):
    """The whole batch was refused (nothing of it was applied). ``reason`` ∈ :data:`REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


def reject(reason: str, message: str) -> RejectedBatch:
    return RejectedBatch(reason, message)


def finite(x: float, where: str, allow_nonfinite: bool = False, why: str = "") -> float:
    """``x`` if finite (or non-finite values are allowed here), else reject with ``why``."""
    if allow_nonfinite or math.isfinite(x):
        return x
    raise reject("nonfinite", f"{where} is {x!r}{why or ' (must be finite)'}")


def norm(x: float, where: str, allow_nonfinite: bool = False, why: str = "") -> float:
    """A gradient norm: like :func:`finite`, but +inf is always a measurement — the float32 sum of
    squares of finite elements overflows above ~1.8e19, the largest spike there is to report."""
    return x if x == math.inf else finite(x, where, allow_nonfinite, why)


def nonneg(x: float, where: str) -> float:
    """A finite value >= 0 (durations, overhead ratios)."""
    if not (math.isfinite(x) and x >= 0):
        raise reject("nonfinite" if not math.isfinite(x) else "invalid_value", f"{where} is {x!r} (must be finite and >= 0)")
    return x


def count(x: int, where: str) -> int:
    if x < 0:
        raise reject("invalid_value", f"{where} is {x} (must be >= 0)")
    return x


def text(s: str, where: str, limit: int = MAX_NAME, required: bool = False) -> str:
    if len(s) > limit:
        raise reject("invalid_value", f"{where} has {len(s)} characters (at most {limit})")
    if required and not s:
        raise reject("invalid_value", f"{where} is empty")
    return s


def rank(r: int, world_size: int, where: str) -> int:
    if not 0 <= r < world_size:
        raise reject("invalid_value", f"{where} is {r}, outside [0, world_size={world_size})")
    return r


def layer_columns(where: str, names: tuple[str, ...], grad_norm: np.ndarray, grad_max_abs: np.ndarray,
                  param_norm: np.ndarray, update_ratio: np.ndarray, nonfinite: np.ndarray,
                  numel: np.ndarray) -> None:
    """Per-layer columns: counts >= 0; norms (and update ratios other than NaN) finite unless that
    layer's nonfinite count > 0. Vectorised: this runs for every step the daemon ingests."""
    for col, field in ((nonfinite, "layer_nonfinite"), (numel, "numel")):
        if col.size and col.min() < 0:
            i = int(np.argmax(col < 0))
            raise reject("invalid_value", f"{where}.{field}[{i}] (layer {names[i]!r}) is {int(col[i])} (must be >= 0)")
    clean = nonfinite == 0
    for col, field in ((grad_norm, "grad_norm"), (grad_max_abs, "grad_max_abs"), (param_norm, "param_norm"),
                       (update_ratio, "update_ratio")):
        if field == "update_ratio":
            bad = np.isinf(col)
        elif field in ("grad_norm", "param_norm"):  # +inf: an overflowed norm of finite elements (see norm)
            bad = np.isnan(col) | (col == -np.inf)
        else:
            bad = ~np.isfinite(col)
        bad &= clean
        if bad.any():
            i = int(np.argmax(bad))
            raise reject("nonfinite", f"{where}.{field}[{i}] (layer {names[i]!r}) is {float(col[i])!r} but the "
                                      "layer's nonfinite count is 0 (non-finite gradient statistics are accepted "
                                      "only with a nonfinite count > 0)")
