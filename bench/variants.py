"""The variants the overhead benchmark times: one model copy each, with its own AdamW.

A variant's step is the training step a user runs: forward and backward of every micro-batch,
the tool's per-step work (gradloc's ``end_step``, a peer's read-out), ``optimizer.step()``,
``zero_grad()``. The gradloc variants use the defaults users get (embedded agent included, its
store in a throw-away file); the peers (``bench/peers.py``) are the tools users reach for instead.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradloc
from bench.models import logits
from gradloc.demo.model import token_losses

# name -> WatchConfig fields; "per_layer" and "per_token" are the two timed by default
GRADLOC_VARIANTS: dict[str, dict[str, Any]] = {
    "per_layer": {"token_stats": False},
    "per_token": {},  # WatchConfig() as users get it
    "per_token_full": {"update_ratio": "full"},  # a full parameter snapshot every step
    "per_token_off": {"update_ratio": "off"},  # no optimizer hooks, no snapshot
    "per_token_rl": {},  # the default, plus per-token RL fields every micro-batch (RLVariant)
    "on_spike": {"token_stats": "on_spike"},  # no module hook on healthy steps (engine/on_spike.py)
}
COMPUTES = {
    "plain": "nothing (baseline)",
    "per_layer": "gradloc per-layer: grad norm / max|g| / non-finite per layer, spike detector, update ratios",
    "per_token": "gradloc default: per-layer + per-token gradient scores (top-k tokens per step), detector",
    "per_token_full": "gradloc default with update_ratio='full' (full parameter snapshot per step)",
    "per_token_off": "gradloc default with update_ratio='off' (no update-to-weight ratios)",
    "on_spike": "gradloc token_stats='on_spike': per-layer statistics and the detector on healthy steps, no module "
                "hook; per-token statistics from re-running a flagged step",
    "per_token_rl": "gradloc default + RL fields (logp, old/rollout logp, advantages, ratio, clipped) and their "
                    "per-step distributions",
}


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


class GradlocVariant(Variant):
    def __init__(self, name: str, model: nn.Module, lr: float, device: str = "cpu", compile: bool = False) -> None:
        super().__init__(name, model, lr, device, compile)
        fields = dict(GRADLOC_VARIANTS[name])
        self.store = os.path.join(tempfile.gettempdir(), f"gradloc-bench-{os.getpid()}-{name}.db")
        config = gradloc.WatchConfig(job="bench", store_path=self.store, **fields)
        self.mon = gradloc.watch(model, self.opt, config=config)
        self.extra["spikes_flagged"] = 0

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, n_tokens: int) -> torch.Tensor:
        with self.mon.micro_batch(y):
            return super().micro_step(x, y, n_tokens)

    def end_step(self, total: torch.Tensor) -> None:
        report = self.mon.end_step(total)
        self.extra["spikes_flagged"] += int(report.spike.is_spike)
        tokens = report.record.tokens  # the last step's: per-token statistics really computed, and complete
        self.extra["unattributed_share"] = None if tokens is None else round(tokens.unattributed_share, 6)

    def close(self) -> None:
        self.mon.close()
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.store + suffix):
                os.remove(self.store + suffix)


class RLVariant(GradlocVariant):
    """The default monitor, and every micro-batch hands over the per-token RL fields a GRPO loss has
    (here from the same cross-entropy step: logp = −CE per token, π_old = π_rollout = its detached
    copy, one advantage per sequence, ratio 1): the extra cost of ``rl_fields`` and its distributions."""

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, n_tokens: int) -> torch.Tensor:
        with self.mon.micro_batch(y):
            per_token = token_losses(logits(self.net, x), y)  # (B, T)
            loss = per_token.sum() / n_tokens
            logp = -per_token.detach()
            ones = torch.ones_like(logp)
            self.mon.rl_fields(logp=logp, old_logp=logp, rollout_logp=logp, advantages=ones[:, 0], ratio=ones,
                               clipped=ones < 0)
            loss.backward()
            return loss.detach()


def make_variant(name: str, model: nn.Module, lr: float, device: str = "cpu", compile: bool = False) -> Variant:
    if name == "plain":
        return Variant(name, model, lr, device, compile).compiled()
    if name == "per_token_rl":
        return RLVariant(name, model, lr, device, compile).compiled()
    if name in GRADLOC_VARIANTS:
        return GradlocVariant(name, model, lr, device, compile).compiled()
    if compile:
        raise ValueError(f"{name}: the peer tools are not run compiled")
    from bench.peers import PEERS  # opacus, backpack, wandb: imported only when asked for

    return PEERS[name](name, model, lr, device)


def computes(name: str) -> str:
    if name in COMPUTES:
        return COMPUTES[name]
    from bench.peers import PEERS

    return PEERS[name].computes
