"""The variants the overhead benchmark times: one model copy each, with its own AdamW.

A variant's step is the training step a user runs: forward and backward of every micro-batch,
the tool's per-step work (gradloc's ``end_step``, a peer's read-out), ``optimizer.step()``,
``zero_grad()``. The gradloc variants use the defaults users get (embedded agent included, its
store in a throw-away file); the peers (``bench/peers.py``) are the tools users reach for instead.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch import nn

import gradloc
from bench.models import logits
from bench.variant import Variant, sync  # noqa: F401  (re-exported: the variants' base)
from gradloc.config import PrecursorConfig
from gradloc.demo.model import token_losses

# name -> WatchConfig fields; "per_layer" and "per_token" are the two timed by default
GRADLOC_VARIANTS: dict[str, dict[str, Any]] = {
    "per_layer": {"token_stats": False},
    "per_token": {},  # WatchConfig() as users get it
    "per_token_full": {"update_ratio": "full"},  # a full parameter snapshot every step
    "per_token_off": {"update_ratio": "off"},  # no optimizer hooks, no snapshot
    "per_token_rl": {},  # the default, plus per-token RL fields every micro-batch (RLVariant)
    "on_spike": {"token_stats": "on_spike"},  # no module hook on healthy steps (engine/on_spike.py)
    "per_token_provenance": {},  # the default, plus each sample's SampleInfo (source, origin, a tag) and a loss mask
    # the defaults without the precursor statistics: what they cost is the default's time over these
    "per_layer_no_precursors": {"token_stats": False, "precursors": PrecursorConfig(enabled=False)},
    "per_token_no_precursors": {"precursors": PrecursorConfig(enabled=False)},
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
    "per_token_provenance": "gradloc default + every sample's provenance (source of 4, origin, a tag) and a loss "
                            "mask: the per-step samples and loss tokens per source, tag and length bucket",
    "per_layer_no_precursors": "gradloc per-layer without the precursor statistics (PrecursorConfig(enabled=False))",
    "per_token_no_precursors": "gradloc default without the precursor statistics (PrecursorConfig(enabled=False))",
}


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


class ProvenanceVariant(GradlocVariant):
    """The default monitor, and every micro-batch hands over its samples' provenance (one of four sources, an
    origin, a tag) and a loss mask: the extra cost of counting each step's data per group (collector/groups.py)."""

    SOURCES = ("web", "code", "books", "forum")

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, n_tokens: int) -> torch.Tensor:
        infos = [gradloc.SampleInfo(source=self.SOURCES[b % 4], origin=f"shard-{b}.jsonl:{b}", tags={"lang": "en"})
                 for b in range(y.shape[0])]
        with self.mon.micro_batch(y, loss_mask=torch.ones_like(y, dtype=torch.bool), sample_infos=infos):
            return Variant.micro_step(self, x, y, n_tokens)


def make_variant(name: str, model: nn.Module, lr: float, device: str = "cpu", compile: bool = False) -> Variant:
    if name == "plain":
        return Variant(name, model, lr, device, compile).compiled()
    if name == "per_token_rl":
        return RLVariant(name, model, lr, device, compile).compiled()
    if name == "per_token_provenance":
        return ProvenanceVariant(name, model, lr, device, compile).compiled()
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
