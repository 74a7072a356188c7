"""Masked-loss probes: ∇θ of the loss restricted to a token subset, on the real model.

A probe is one forward + backward over one micro-batch through the user's closure
``probe(micro_batch, token_mask) -> loss`` (same loss and scaling as training, per-token terms
multiplied by ``token_mask``). Inside a :class:`ProbeSession` the training gradients are moved
aside (the very tensor objects, no copy), module buffers and RNG are saved, and gradloc's own hooks
are suspended; on exit all of it is put back, so the optimizer step is bit-for-bit unchanged.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import nn

from gradloc.collector.batch import MicroBatchMeta, RngState
from gradloc.collector.layer_stats import foreach_norms
from gradloc.errors import ProbeError

ProbeFn = Callable[[int, torch.Tensor], torch.Tensor]
Grads = list[torch.Tensor | None]


class ProbeSession:
    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter], metas: Sequence[MicroBatchMeta],
                 closure: ProbeFn, suspend: Callable[[bool], None]) -> None:
        self.model, self.params, self.closure, self._suspend = model, list(params), closure, suspend
        self.metas = {m.index: m for m in metas}
        self.count = 0
        self.losses: list[float] = []  # each probe's loss value (same scaling as training)
        self._saved: Grads = []
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rng: RngState | None = None

    def __enter__(self) -> "ProbeSession":
        self._saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        self._buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        self._rng = RngState.capture()
        self._suspend(True)
        return self

    def __exit__(self, *exc: object) -> None:
        for p, g in zip(self.params, self._saved):
            p.grad = g
        with torch.no_grad():
            for buf, saved in self._buffers:
                buf.copy_(saved)
        if self._rng is not None:
            self._rng.restore()
        self._suspend(False)

    def grad(self, micro_batch: int, token_mask: torch.Tensor) -> Grads:
        """Gradient of the loss restricted to ``token_mask`` (B×T bool) of ``micro_batch``."""
        meta = self.metas[micro_batch]
        meta.rng.restore()
        self.count += 1
        loss = self.closure(micro_batch, token_mask)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ProbeError("the probe closure must return a scalar loss tensor that requires grad")
        self.losses.append(float(loss.detach()))
        loss.backward()
        out = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return out

    def norm(self, micro_batch: int, token_mask: torch.Tensor) -> float:
        return grad_norm(self.grad(micro_batch, token_mask))


def add_into(acc: Grads, more: Grads) -> Grads:
    return [b if a is None else (a if b is None else a + b) for a, b in zip(acc, more)]


def grad_norm(grads: Grads) -> float:
    present = [g for g in grads if g is not None]
    if not present:
        return 0.0
    return float(foreach_norms(present).double().norm())


def dot(a: Grads, b: Grads, b_scale: float = 1.0) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for x, y in zip(a, b):
        if x is not None and y is not None:
            total += (x.double() * y.double()).sum().cpu()
    return float(total) * b_scale


def finite(x: float) -> bool:
    return math.isfinite(x)
