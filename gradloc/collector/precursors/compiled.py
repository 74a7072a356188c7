"""Precursor statistics inside torch.compile graphs: the loss head's, the final norm's and the routers', folded on the
device into accumulators that live across steps.

Inside a compiled region a module's forward hooks run only while dynamo traces them. The eager path's step slots (a
dict filled as calls come, emptied every step: slots.StepSlots) cannot be used there — dynamo would guard on the
dict and trace again every step. So a module measured under compile gets, when its hooks are installed, one
persistent float64 accumulator per statistic, laid out as a slot (``[value | count | extreme | at (3)]``,
slots.identity), and the traced hook folds the call's values into it **in place** (``acc.copy_(...)``: an input
mutation, which the compiled graph performs; the accumulator's identity is what dynamo guards, so the graph is
traced once). Whether a micro-batch block is open and its index are two 0-d device tensors set eagerly when a block
opens and closes (``on``, ``micro_batch``): a call outside a block folds nothing, and no Python value that changes
per step reaches the traced code. ``take`` (eager, at the end of the step) hands the accumulators to the step's pack
and resets them in place; an accumulator nothing was folded into stays at its identity and is left out on the host
(stats.to_stats).

Attention inside compiled graphs is found and measured by traced_attention.py into these accumulators.
"""
from __future__ import annotations

import torch

from gradloc.collector.precursors.slots import Reduce, SlotKey, identity


class Folds:
    """The accumulators of the statistics measured under torch.compile (``prepare`` eagerly, ``fold`` traced)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.acc: dict[SlotKey, torch.Tensor] = {}
        self._start: dict[SlotKey, torch.Tensor] = {}  # each accumulator's identity, on the device (resets copy it)
        self.on = torch.zeros((), dtype=torch.float64, device=device)  # 1 while a micro-batch block is open
        self.micro_batch = torch.zeros((), dtype=torch.float64, device=device)  # its index in the step
        self.attend = torch.zeros((), dtype=torch.float64, device=device)  # 1 while attention is measured

    def prepare(self, key: SlotKey) -> None:
        if key not in self.acc:
            self._start[key] = torch.tensor(identity(key), dtype=torch.float64, device=self.device)  # (size + 5,)
            self.acc[key] = self._start[key].clone()

    def begin(self, micro_batch: int, attend: bool = False) -> None:
        self.micro_batch.fill_(float(micro_batch))
        self.on.fill_(1.0)
        self.attend.fill_(1.0 if attend else 0.0)

    def end(self) -> None:
        self.on.fill_(0.0)
        self.attend.fill_(0.0)

    def fold(self, key: SlotKey, value: torch.Tensor, count: torch.Tensor | float = 1.0,
             extreme: torch.Tensor | None = None, at: torch.Tensor | None = None, attention: bool = False,
             first: bool = False) -> None:
        """Fold one call into ``key``'s accumulator, in place (traced into the compiled graph); a key not prepared
        is not measured. ``attention``: gated by ``attend``, not only by an open block. ``first``: only the step's
        first call is kept (a device test on the accumulator's count: no Python state), its values as they are
        (−inf too)."""
        acc = self.acc.get(key)
        if acc is None:
            return
        n, on = key.size, self.attend if attention else self.on
        if first:
            on = on * (acc[n] == 0)
        v = value.detach().reshape(-1).to(torch.float64)  # (size,)
        cur = acc[:n]
        if key.reduce is Reduce.MAX:
            new = torch.where(on > 0, torch.maximum(cur, v), cur)
        else:  # a first call's values replace the identity as they are; a sum's are added, off blocks adding 0
            new = torch.where(on > 0, cur + v, cur) if first else cur + v * on
        parts = [new, (acc[n] + on * count).reshape(1)]
        if extreme is not None and at is not None:
            e = extreme.detach().to(torch.float64).reshape(())
            better = ((e < acc[n + 1]) if key.lowest else (e > acc[n + 1])) & (on > 0)
            here = torch.cat([self.micro_batch.reshape(1), at.detach().to(torch.float64).reshape(2)])  # (3,)
            parts += [torch.where(better, e, acc[n + 1]).reshape(1), torch.where(better, here, acc[n + 2:])]
        else:
            parts.append(acc[n + 1:])
        acc.copy_(torch.cat(parts))  # (size + 5,)

    def take(self) -> tuple[tuple[SlotKey, ...], torch.Tensor | None]:
        """The accumulators' keys and their values packed as slots.StepSlots.take packs them; each starts over."""
        if not self.acc:
            return (), None
        keys = tuple(self.acc)
        pack = torch.cat([self.acc[k] for k in keys])  # Σ (size + 5): a copy
        for k in keys:
            self.acc[k].copy_(self._start[k])  # on the device: no host copy
        return keys, pack


__all__ = ["Folds"]
