"""A small DDP training job for the distributed tests: TinyGPT, per-rank data, a culprit planted on one rank.

Each rank trains on its own micro-batches (the global batch is their union); the loss of rank r's
micro-batch i is Σ w·mask·ce / (B·T·M) — DDP averages the gradients over ranks, so the job's
gradient is that of the mean over ranks. ``plant`` = (rank, step, micro-batch, sample, position)
multiplies one token's loss weight by 3000 on that rank only. ``pad`` = (rank, step): a real data
fault instead — that rank's loader emits rows of padding at that step, every input and label the pad
id, with the labels left in the loss (a classic pipeline bug: no sample of it stands out, the rank does).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

import gradloc
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses

VOCAB, SEQ, B, M = 128, 16, 4, 2
PAD = 0


def data(rank: int, steps: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    tokens = torch.randint(VOCAB, (steps, M, B, SEQ + 1), generator=g)
    return tokens[..., :-1].clone(), tokens[..., 1:].clone(), torch.ones(steps, M, B, SEQ)


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(vocab=VOCAB, seq=SEQ, d_model=32, n_layers=2, n_heads=4, dropout=0.0))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    return model


def train(rank: int, world: int, kind: str, steps: int, plant: tuple | None = None, monitor: bool = True,
          remedy: str | None = None, lr: float = 1e-3, pad: tuple[int, int] | None = None,
          **watch: Any) -> dict[str, Any]:
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    x, y, w = data(rank, steps)
    if plant is not None and plant[0] == rank:
        _, s, mb, b, t = plant
        w[s, mb, b, t] = 3000.0
    if pad is not None and pad[0] == rank:
        x[pad[1]], y[pad[1]] = PAD, PAD
    watch = {"store": False, **watch}
    mon = gradloc.watch(model, opt, detector=gradloc.DetectorConfig(warmup=5), remedy=remedy,
                        **watch) if monitor else None
    from tests.distributed.loop import run_steps

    reports, collectives = run_steps(
        model, opt, mon, (x, y, w), steps, token_losses=token_losses, clip=1.0,
        no_sync=lambda i: model.no_sync() if kind == "ddp" and i < M - 1 else contextlib.nullcontext())
    if mon is not None:
        mon.close()
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    history = [{s.layer: s.update_ratio for s in rec.layers} for rec in mon.history] if mon is not None else []
    return {"reports": reports, "params": params, "collectives": collectives, "history_ratios": history,
            "kind": mon.job.kind if mon is not None else None}
