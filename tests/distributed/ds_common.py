"""Shared by the DeepSpeed tests: the tiny job (sizes, data, loss), ZeRO configs, the shm op's build dir."""
from __future__ import annotations

import importlib.util
import os

from tests.distributed.launch import ROOT

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
EXT_DIR = os.path.join(ROOT, ".torch_extensions")  # DeepSpeed JIT-builds its shm comm op here, once (gitignored)
ENV = {"TORCH_EXTENSIONS_DIR": EXT_DIR}
VOCAB, SEQ, D_MODEL, B = 64, 16, 32, 2


def zero_config(stage: int) -> dict:
    """ZeRO-3 keeps parameters under 1e5 elements whole on every rank by default (all of TinyGPT's):
    threshold 0 partitions them all, as in a large model (``p.shape`` (0,) outside forward)."""
    return {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}


def data(step: int, rank: int, micro: int):
    """Inputs and targets (B, T) of one rank's micro-batch: every process can rebuild every rank's."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randint(0, VOCAB, (B, SEQ), generator=g), torch.randint(0, VOCAB, (B, SEQ), generator=g)


def loss_fn(logits, y):
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))  # (B, T, V) -> (B·T, V)


def engine_params(engine, stage: int) -> dict:
    """name -> full parameter (ZeRO-3: gathered, a collective: call it on every rank)."""
    import deepspeed

    named = list(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().clone() for n, p in named}
    return {n: p.detach().clone() for n, p in named}
