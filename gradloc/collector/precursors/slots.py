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


@dataclass(frozen=True)
class _Call:
    value: torch.Tensor
    count: torch.Tensor | float
    extreme: torch.Tensor | None
    at: torch.Tensor | None
    micro_batch: int


class _Constants:
    """Small float64 device constants the packs repeat every step (a count, a micro-batch index, an identity's
    tail), made once per device and value: a ``torch.full`` each per slot and step otherwise. Bounded."""

    KEPT = 256

    def __init__(self) -> None:
        self._kept: dict[tuple[str, tuple[float, ...]], torch.Tensor] = {}

    def __call__(self, device: torch.device, *values: float) -> torch.Tensor:
        key = (str(device), values)
        hit = self._kept.get(key)
        if hit is None:
            if len(self._kept) >= self.KEPT:  # counts that change every step (a mask's kept positions): rebuilt
                self._kept.clear()
            hit = torch.empty(len(values), dtype=torch.float64, device=device)
            for i, v in enumerate(values):  # filled on the device: a copy from the host (``torch.tensor(...,
                hit[i].fill_(v)             # device=...)``) would wait for the device's stream on a GPU
            self._kept[key] = hit
        return hit


class StepSlots:
    """The step's slots (``update`` in hooks, ``take`` at end_step). A call's values are kept as they came and folded
    at ``take``: most slots get one call a step (an attention layer in the first micro-batch), packed as it is, where
    folding each call into its slot's identity as it came cost ~15 small device ops a call (BENCHMARKS §1)."""

    def __init__(self) -> None:
        self._slots: dict[SlotKey, list[_Call]] = {}
        self._const = _Constants()

    def __bool__(self) -> bool:
        return bool(self._slots)

    def update(self, key: SlotKey, value: torch.Tensor, *, micro_batch: int, count: torch.Tensor | float = 1.0,
               extreme: torch.Tensor | None = None, at: torch.Tensor | None = None) -> None:
        """Fold one call's ``value`` (``key.size`` values) into the step's; ``extreme`` (a 0-d tensor) and ``at``
        ((row, position)) replace the kept ones when more extreme (smaller when ``key.lowest``, else larger; a NaN
        never does)."""
        located = extreme is not None and at is not None
        self._slots.setdefault(key, []).append(_Call(
            value=value.detach(), count=count.detach() if isinstance(count, torch.Tensor) else float(count),
            extreme=extreme.detach() if located else None, at=at.detach() if located else None,
            micro_batch=micro_batch))

    def _fold(self, key: SlotKey, calls: list[_Call]) -> list[torch.Tensor]:
        """A slot's pack ``[value | count | extreme | at (3)]`` from its calls, as folding them one by one into its
        identity (``identity``) makes it: a NaN extreme never taken (left at ∓inf, where its place is not read:
        ``unpack`` reads none for an extreme not finite)."""
        first, dev = calls[0], calls[0].value.device
        inf, big = float("inf"), float("inf") if key.lowest else float("-inf")
        value = first.value.reshape(-1)  # (size,)
        counts = [c.count for c in calls]
        count = self._const(dev, sum(counts)) if not any(isinstance(c, torch.Tensor) for c in counts) else \
            sum(c.reshape(1).to(torch.float64) if isinstance(c, torch.Tensor) else c for c in counts)
        located = [c for c in calls if c.extreme is not None]
        if located:
            extreme = located[0].extreme.reshape(1).nan_to_num(nan=big, posinf=inf, neginf=-inf)
            if len(calls) == 1:  # its place as two parts of the pack: no cat of its own
                return [value, count, extreme, self._const(dev, float(located[0].micro_batch)),
                        located[0].at.reshape(2)]
            extreme = extreme.to(torch.float64)
            here = torch.cat([self._const(dev, float(located[0].micro_batch)), located[0].at.reshape(2)])  # (3,)
        for c in calls[1:]:
            v = c.value.reshape(-1).to(torch.float64)
            value = torch.maximum(value, v) if key.reduce is Reduce.MAX else value.to(torch.float64) + v
        for c in located[1:]:
            e = c.extreme.reshape(1).to(torch.float64)
            better = e < extreme if key.lowest else e > extreme
            extreme = torch.where(better, e, extreme)
            here = torch.where(better, torch.cat([self._const(dev, float(c.micro_batch)), c.at.reshape(2)]), here)
        if not located:
            return [value, count, self._const(dev, big, -1.0, -1.0, -1.0)]
        return [value, count, extreme, here]

    def take(self) -> tuple[tuple[SlotKey, ...], torch.Tensor | None]:
        """The step's keys and their packed values (None when nothing was measured); the slots start over."""
        slots, self._slots = self._slots, {}
        if not slots:
            return (), None
        parts = [p for k, calls in slots.items() for p in self._fold(k, calls)]
        return tuple(slots), torch.cat(parts).to(torch.float64)  # Σ (size + 5) values (a float64 part promotes all)

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
