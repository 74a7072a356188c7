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
        self._buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []  # (module, name, buffer, copy)
        self._rng: RngState | None = None

    def __enter__(self) -> "ProbeSession":
        self._saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        self._buffers = _save_buffers(self.model)
        self._rng = RngState.capture()
        self._suspend(True)
        return self

    def __exit__(self, *exc: object) -> None:
        for p, g in zip(self.params, self._saved):
            p.grad = g
        with torch.no_grad():
            for module, name, buf, saved in self._buffers:
                setattr(module, name, buf)  # a forward may have re-registered it (dynamic RoPE's inv_freq)
                buf.copy_(saved)
        if self._rng is not None:
            self._rng.restore()
        self._suspend(False)

    def grad(self, micro_batch: int, token_mask: torch.Tensor) -> Grads:
        """Gradient of the loss restricted to ``token_mask`` (B×T bool) of ``micro_batch``."""
        return self.add_to([None] * len(self.params), micro_batch, token_mask)

    def add_to(self, acc: Grads, micro_batch: int, token_mask: torch.Tensor) -> Grads:
        """``acc`` + the gradient of one probe, accumulated in place by autograd (∇ is linear in
        the token mask, so probing disjoint sets and summing gives the gradient of their union);
        holds one gradient copy however many probes are summed."""
        meta = self.metas[micro_batch]
        for p, a in zip(self.params, acc):
            p.grad = a
        meta.rng.restore()
        self.count += 1
        try:
            loss = self.closure(micro_batch, token_mask)
            if getattr(self.closure, "runs_backward", False):  # a pipeline probe: its own schedule ran backward
                self.losses.append(float(loss))
                return [p.grad for p in self.params]
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise ProbeError("the probe closure must return a scalar loss tensor that requires grad")
            self.losses.append(float(loss.detach()))
            loss.backward()
            return [p.grad for p in self.params]
        finally:
            for p in self.params:
                p.grad = None


def _save_buffers(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]:
    """Every registered buffer, where it is registered and a copy of its values (one copy per tensor)."""
    copies: dict[int, torch.Tensor] = {}
    out = []
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if id(buf) not in copies:
                copies[id(buf)] = buf.detach().clone()
            out.append((module, name, buf, copies[id(buf)]))
    return out


def add_into(acc: Grads, more: Grads) -> Grads:
    """``acc`` += ``more`` in place where ``acc`` has a tensor (``more``'s tensors are not kept)."""
    out: Grads = []
    for a, b in zip(acc, more):
        if a is None:
            out.append(None if b is None else b.clone())
        else:
            if b is not None:
                a.add_(b)
            out.append(a)
    return out


_CHUNK = 1 << 22  # elements per float64 chunk: bounds the temporaries of a dot on a huge parameter


def _device_total(parts: list[torch.Tensor]) -> float:
    """Σ of 0-d float64 tensors that may live on several devices: one transfer per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in parts:
        by_device.setdefault(t.device, []).append(t)
    return float(sum(float(torch.stack(ts).sum()) for ts in by_device.values()))


def grad_norm(grads: Grads) -> float:
    present = [g for g in grads if g is not None]
    if not present:
        return 0.0
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in present:
        by_device.setdefault(g.device, []).append(g)
    return math.sqrt(_device_total([foreach_norms(ts).double().pow(2).sum() for ts in by_device.values()]))


def dot(a: Grads, b: Grads, b_scale: float = 1.0) -> float:
    """⟨a, b⟩ · b_scale in float64, chunked so a huge parameter never gets a full float64 copy."""
    parts = []
    for x, y in zip(a, b):
        if x is None or y is None:
            continue
        xf, yf = x.reshape(-1), y.reshape(-1)  # (*shape) -> (numel,)
        for i in range(0, xf.numel(), _CHUNK):
            parts.append(torch.dot(xf[i:i + _CHUNK].double(), yf[i:i + _CHUNK].double()))
    return _device_total(parts) * b_scale if parts else 0.0


def distance(a: Grads, b: Grads, a_scale: float = 1.0) -> float:
    """‖a · a_scale − b‖ in float64, chunked (exact where ‖a‖² − 2⟨a, b⟩ + ‖b‖² would cancel)."""
    parts = []
    for x, y in zip(a, b):
        if x is None and y is None:
            continue
        if x is None or y is None:
            t = (y if x is None else x).reshape(-1)  # (*shape) -> (numel,)
            k = 1.0 if x is None else a_scale
            parts += [(t[i:i + _CHUNK].double() * k).pow(2).sum() for i in range(0, t.numel(), _CHUNK)]
            continue
        xf, yf = x.reshape(-1), y.reshape(-1)  # (*shape) -> (numel,)
        parts += [(xf[i:i + _CHUNK].double() * a_scale - yf[i:i + _CHUNK].double()).pow(2).sum()
                  for i in range(0, xf.numel(), _CHUNK)]
    return math.sqrt(_device_total(parts)) if parts else 0.0
