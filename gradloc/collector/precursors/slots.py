"""One step's precursor values, accumulated on the device across micro-batches and module calls, read in the step's
one host transfer.

A slot is one statistic of one module: a value vector (one value, one per head, one per expert), how many things it
summed, and an extreme with where it was reached. Packed per slot as ``[value (n) | count | extreme | at (3)]``
(float64), the slots in the order they were first filled; the host reads them back with the keys kept beside.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch


class Reduce(Enum):
    MAX = "max"  # the largest value over calls
    SUM = "sum"  # summed over calls (a mean's numerator: the count is its denominator)


@dataclass(frozen=True)
class SlotKey:
    stat: str  # what the collector measured ("attn_max_logit", "attn_entropy", "expert_counts", …)
    layer: str
    reduce: Reduce
    size: int  # values of the slot: heads, experts, or 1
    lowest: bool = False  # the kept extreme is the smallest one (an entropy's lowest row), else the largest


def packed_size(key: SlotKey) -> int:
    """A slot's values in a pack: ``[value (size) | count | extreme | at (3)]``."""
    return key.size + 5


def identity(key: SlotKey) -> list[float]:
    """A slot's pack before anything was folded into it (a MAX slot's value at −inf, a SUM's at 0, no count, the
    extreme at ∓inf, no location): what it contributes when combined with others (collector/precursors/job.py)."""
    big = float("inf")
    return [-big if key.reduce is Reduce.MAX else 0.0] * key.size + [0.0, big if key.lowest else -big, -1.0, -1.0, -1.0]


class _Slot:
    def __init__(self, key: SlotKey, device: torch.device) -> None:
        big = float("inf")  # identity(key), made on the device (no host copy on the hot path)
        self.value = torch.full((key.size,), -big if key.reduce is Reduce.MAX else 0.0, dtype=torch.float64,
                                device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.extreme = torch.full((), big if key.lowest else -big, dtype=torch.float64, device=device)
        self.at = torch.full((3,), -1.0, dtype=torch.float64, device=device)


class StepSlots:
    """The step's slots (``update`` in hooks, ``take`` at end_step)."""

    def __init__(self) -> None:
        self._slots: dict[SlotKey, _Slot] = {}

    def __bool__(self) -> bool:
        return bool(self._slots)

    def update(self, key: SlotKey, value: torch.Tensor, *, micro_batch: int, count: torch.Tensor | float = 1.0,
               extreme: torch.Tensor | None = None, at: torch.Tensor | None = None) -> None:
        """Fold one call's ``value`` (``key.size`` values) into the step's; ``extreme`` (a 0-d tensor) and ``at``
        ((row, position)) replace the kept ones when more extreme (smaller when ``key.lowest``, else larger)."""
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(key, value.device)
        v = value.detach().reshape(-1).to(torch.float64)  # (size,)
        slot.value = torch.maximum(slot.value, v) if key.reduce is Reduce.MAX else slot.value + v
        slot.count = slot.count + count
        if extreme is not None and at is not None:
            e = extreme.detach().to(torch.float64)
            better = e < slot.extreme if key.lowest else e > slot.extreme
            here = torch.cat([torch.full((1,), float(micro_batch), dtype=torch.float64, device=e.device),
                              at.detach().to(torch.float64).reshape(2)])  # (3,): micro-batch, row, position
            slot.extreme = torch.where(better, e, slot.extreme)
            slot.at = torch.where(better, here, slot.at)

    def take(self) -> tuple[tuple[SlotKey, ...], torch.Tensor | None]:
        """The step's keys and their packed values (None when nothing was measured); the slots start over."""
        slots, self._slots = self._slots, {}
        if not slots:
            return (), None
        parts = [torch.cat([s.value, s.count.reshape(1), s.extreme.reshape(1), s.at]) for s in slots.values()]
        return tuple(slots), torch.cat(parts)  # Σ (size + 5) values

    def clear(self) -> None:
        self._slots = {}


@dataclass(frozen=True)
class SlotValues:
    value: np.ndarray  # (size,)
    count: float
    extreme: float
    at: tuple[int, int, int] | None
    rank: int | None = None  # a job's value: the rank whose micro-batch ``at`` is in (collector/precursors/job.py)


def unpack(keys: tuple[SlotKey, ...], host: np.ndarray) -> dict[SlotKey, SlotValues]:
    """The host copy of ``take``'s pack, by key."""
    out, pos = {}, 0
    for k in keys:
        part = host[pos:pos + packed_size(k)]
        pos += packed_size(k)
        at = part[k.size + 2:]
        ok = np.isfinite(part[k.size + 1]) and bool((at >= 0).all())
        out[k] = SlotValues(part[:k.size].copy(), float(part[k.size]), float(part[k.size + 1]),
                            tuple(int(v) for v in at) if ok else None)
    if pos != len(host):
        raise ValueError(f"a precursor pack of {len(host)} values for slots of {pos}")
    return out


__all__ = ["Reduce", "SlotKey", "SlotValues", "StepSlots", "identity", "packed_size", "unpack"]
