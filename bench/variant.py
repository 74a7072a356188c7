"""One timed training step of a model copy with its own AdamW: the base of every variant the overhead benchmark times
(``bench/variants.py``: plain and gradloc's; ``bench/peers.py``: the peer tools). Its own module so that the
peers and the variants both build on it without importing each other."""
from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bench.models import logits
from gradloc.demo.model import token_losses


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Variant:
    """Plain training: no monitoring. Subclasses add their tool's work to the same step."""

    def __init__(self, name: str, model: nn.Module, lr: float, device: str = "cpu", compile: bool = False) -> None:
        self.name, self.model, self.device, self.compile = name, model, device, compile
        self.net = model  # what the step calls: the model, or its torch.compile wrapper (set by ``compiled``)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.step_s: list[float] = []
        self.cpu_s: list[float] = []  # process CPU time of the step: insensitive to preemption
        self.phase_s: dict[str, list[float]] = {"fwd_bwd": [], "end_step": [], "opt_step": []}
        self.extra: dict[str, Any] = {}  # per-variant facts for the JSON (spikes flagged, service CPU…)

    def compiled(self) -> "Variant":
        """With ``compile``: the step calls ``torch.compile(model)`` (inductor), created after any monitor
        is attached, so hooks registered before its first call are traced (collector/compiled.py)."""
        if self.compile:
            self.net = torch.compile(self.model)
        return self

    def params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, n_tokens: int) -> torch.Tensor:
        loss = token_losses(logits(self.net, x), y).sum() / n_tokens
        loss.backward()
        return loss.detach()

    def end_step(self, total: torch.Tensor) -> None:
        pass

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], n_tokens: int, record: bool) -> None:
        c0 = time.process_time()
        t0 = time.perf_counter()
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(batches):
            # DDP: the gradient all-reduce runs with the last micro-batch's backward only, as users run it
            accumulate = i < len(batches) - 1 and isinstance(self.model, DistributedDataParallel)
            with self.model.no_sync() if accumulate else contextlib.nullcontext():
                total += self.micro_step(x, y, n_tokens)
        sync(self.device)
        t1 = time.perf_counter()
        self.end_step(total)
        sync(self.device)
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        sync(self.device)
        t3 = time.perf_counter()
        c3 = time.process_time()
        if record:
            self.step_s.append(t3 - t0)
            self.cpu_s.append(c3 - c0)
            self.phase_s["fwd_bwd"].append(t1 - t0)
            self.phase_s["end_step"].append(t2 - t1)
            self.phase_s["opt_step"].append(t3 - t2)

    def close(self) -> None:
        pass


__all__ = ["Variant", "sync"]
