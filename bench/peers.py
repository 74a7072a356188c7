"""The tools users reach for instead of gradloc, as overhead-benchmark variants (``--peers``).

Each wraps its own copy of the same TinyGPT and runs the same training step as ``plain``, plus
what the tool needs to produce its statistic every step, read back to the host at ``end_step``
(where gradloc moves its step record to the host):

- ``opacus_ghost``: Opacus' ``GradSampleModuleFastGradientClipping`` (ghost clipping on):
  per-sample (per-sequence) gradient L2 norms without materializing per-sample gradients
  (Linear: from (T, T) Gram matrices of activations and output gradients; Embedding: by
  summing the rows each sample touches; LayerNorm: per-sample gradients, then their norm).
  Timed: forward, one ordinary ``loss.backward()`` (its hooks compute every parameter's
  per-sample norm), ``get_norm_sample()`` after each micro-batch. Not timed: the second,
  re-weighted backward of ``DPLossFastGradientClipping`` — it exists to *clip*, which changes
  the update; observing the norms needs only the first pass.
- ``backpack_l2``: BackPACK's ``BatchL2Grad`` on ``extend(model)``: per-sample squared gradient
  norms per parameter, summed over parameters after each micro-batch.
- ``wandb_watch``: ``wandb.watch(model, log="gradients", log_freq=1)`` in offline mode: a
  64-bin histogram of every parameter's gradient every backward, plus ``run.log({"loss": …})``
  per step (what commits the histograms).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from typing import Any

import torch
from torch import nn

from bench.variant import Variant
from gradloc.demo.model import TinyGPT


class ContiguousTinyGPT(TinyGPT):
    """TinyGPT whose embedding lookups see contiguous id tensors.

    Opacus' embedding norm sampler calls ``input_ids.view(-1, 1)``, which fails on TinyGPT's
    position ids (``arange(T).expand(B, T)``: stride 0 on B) and on token ids sliced from a
    (B, T + 1) batch. Making both contiguous copies the same values, so the forward and backward
    compute the same numbers; only the Opacus variant uses this class (its weights are loaded
    from the shared initial model)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device).expand(B, T).contiguous()  # (T,) -> (B, T), dense
        x = self.tok(idx.contiguous()) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, V)


class OpacusGhost(Variant):
    computes = "Opacus ghost clipping hooks: per-sample (per-sequence) gradient L2 norm over all parameters"

    def __init__(self, name: str, model: nn.Module, lr: float, device: str = "cpu") -> None:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        if not isinstance(model, TinyGPT):
            raise TypeError("the Opacus variant runs on TinyGPT (ghost clipping refuses tied embeddings)")
        inner = ContiguousTinyGPT(model.cfg).to(device)
        inner.load_state_dict(model.state_dict())
        # loss_reduction="sum": the hooks take the loss as given (our loss is already a sum / tokens),
        # so each norm is that of one sequence's contribution to the step's gradient, as BackPACK's
        gsm = GradSampleModuleFastGradientClipping(inner, batch_first=True, loss_reduction="sum",
                                                   max_grad_norm=1.0, use_ghost_clipping=True)
        super().__init__(name, gsm, lr, device)
        self._norms: list[torch.Tensor] = []
        self.last: list[float] = []
        # fired by every Embedding's full backward hook (its integer input needs no gradient)
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, n_tokens: int) -> torch.Tensor:
        loss = super().micro_step(x, y, n_tokens)
        self._norms.append(self.model.get_norm_sample())  # (B,): per-sample norm over all parameters
        return loss

    def end_step(self, total: torch.Tensor) -> None:
        self.last = torch.cat(self._norms).tolist()  # (M·B,) to the host
        self._norms.clear()


class BackpackL2(Variant):
    computes = ("BackPACK BatchL2Grad: per-sample (per-sequence) squared gradient norms of Linear and Embedding "
                "parameters (LayerNorm unsupported: left out)")

    def __init__(self, name: str, model: nn.Module, lr: float, device: str = "cpu") -> None:
        from backpack import extend
        from backpack.extensions import BatchL2Grad

        super().__init__(name, extend(model), lr, device)
        self._ext = BatchL2Grad()
        self._sq: list[torch.Tensor] = []
        self.last: list[float] = []
        # BatchL2Grad warns (fail_mode "WARNING") for every module with parameters and no extension:
        # LayerNorm, and the Block / TinyGPT containers whose parameters belong to their children
        warnings.filterwarnings("ignore", message="Extension saving to batch_l2 does not have an extension")
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        self.extra["params_without_batch_l2"] = None  # filled after the first backward

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, n_tokens: int) -> torch.Tensor:
        from backpack import backpack

        with backpack(self._ext):
            loss = super().micro_step(x, y, n_tokens)
        named = list(self.model.named_parameters())
        if self.extra["params_without_batch_l2"] is None:
            self.extra["params_without_batch_l2"] = [n for n, p in named if not hasattr(p, "batch_l2")]
        self._sq.append(torch.stack([p.batch_l2 for _, p in named if hasattr(p, "batch_l2")]).sum(0))  # (P, B) -> (B,)
        return loss

    def end_step(self, total: torch.Tensor) -> None:
        self.last = torch.cat(self._sq).sqrt().tolist()  # (M·B,) per-sample norms to the host
        self._sq.clear()


class WandbWatch(Variant):
    computes = "wandb.watch(log='gradients', log_freq=1), offline: a 64-bin histogram per parameter per backward"

    def __init__(self, name: str, model: nn.Module, lr: float, device: str = "cpu") -> None:
        self._dir = tempfile.mkdtemp(prefix="gradloc-bench-wandb-")
        os.environ.update(WANDB_MODE="offline", WANDB_DIR=self._dir, WANDB_SILENT="true")
        import wandb

        super().__init__(name, model, lr, device)
        self.run = wandb.init(mode="offline", dir=self._dir, project="gradloc-bench")
        wandb.watch(model, log="gradients", log_freq=1)
        self._service = _service_processes()

    def end_step(self, total: torch.Tensor) -> None:
        self.run.log({"loss": total.item()})

    def close(self) -> None:
        # the wandb-core service process works beside us: its CPU time is not in our process' cpu_s
        self.extra["service_cpu_s"] = round(sum(_cpu_s(p) for p in self._service), 2)
        self.run.finish()
        shutil.rmtree(self._dir, ignore_errors=True)


def _service_processes() -> list[Any]:
    try:
        import psutil
    except ImportError:
        return []
    return psutil.Process().children(recursive=True)


def _cpu_s(proc: Any) -> float:
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except Exception:  # the process is gone
        return 0.0


PEERS: dict[str, type[Variant]] = {"opacus_ghost": OpacusGhost, "backpack_l2": BackpackL2, "wandb_watch": WandbWatch}
