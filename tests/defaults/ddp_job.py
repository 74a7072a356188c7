"""Framework defaults: DistributedDataParallel built the way PyTorch's docs build it, around a Hugging Face model.

Each rank trains a tiny random ``LlamaForCausalLM`` (it has buffers, as every rotary HF model has:
``rotary_emb.inv_freq``) wrapped in ``DistributedDataParallel(model, **kwargs)`` with DDP's defaults (
``broadcast_buffers=True``) or one documented option (``find_unused_parameters``, ``static_graph``,
``gradient_as_bucket_view``, a compression comm hook), and the README's loop: two micro-batches, ``no_sync`` on
the first, ``end_step(loss, probe=...)`` before clipping, the default detector. After ``HEALTHY`` healthy steps
one token of one sample on ``PLANT_RANK`` gets its loss weighted ×3000.

One process per rank runs every variant in turn (transformers' import is paid once), each with gradloc and
without it (the bitwise check), and returns picklable figures.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable

import torch

VOCAB, SEQ, B, M = 96, 16, 4, 2
HEALTHY = 32  # healthy steps before the plant: past the default detector's warm-up
STEPS = HEALTHY + 2
PLANT = (2, 1, 1, 9)  # (plant on the last rank) step offset after HEALTHY is 0: (micro-batch, sample, position) below


def variants() -> dict[str, dict[str, Any]]:
    """Name -> DDP kwargs (``comm_hook``: a torch default hook registered after construction; ``compile``: the
    DDP model compiled whole; ``accumulate``:
    "sync" runs every micro-batch's backward synchronised — ``static_graph=True`` does not take ``no_sync``
    accumulation in torch 2.13: the reducer's internal assert fails on the next backward, without gradloc too)."""
    return {
        "defaults": {},
        "find_unused_parameters": {"find_unused_parameters": True},
        "static_graph": {"static_graph": True, "accumulate": "sync"},
        "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
        "fp16_compress_hook": {"comm_hook": "fp16"},
        "compiled": {"compile": True},  # torch.compile(DDP(model)), as PyTorch's DDP + compile docs do
    }


def llama(vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny random ``LlamaForCausalLM`` (seeded): it has buffers (``rotary_emb.inv_freq``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def build(kwargs: dict[str, Any]) -> torch.nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    model = llama()
    kwargs = {k: v for k, v in kwargs.items() if k not in ("accumulate", "compile")}
    hook = kwargs.pop("comm_hook", None)
    ddp = DistributedDataParallel(model, **kwargs)
    if hook is not None:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)  # bf16's requires CUDA/NCCL or XPU
    return ddp


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + 1000 * rank)
    ids = torch.randint(1, VOCAB, (STEPS, M, B, SEQ + 1), generator=g)
    return ids[..., :-1].clone(), ids[..., 1:].clone(), torch.ones(STEPS, M, B, SEQ)


def train(rank: int, world: int, kwargs: dict[str, Any], monitor: bool, plant_rank: int,
          builder: Callable[[dict[str, Any]], torch.nn.Module] = build) -> dict[str, Any]:
    """One run of the README's loop around ``builder(kwargs)`` (DDP here; tests/defaults/fsdp_job.py builds
    FSDP2 and HSDP with it). ``delivered``: the norm of the whole gradient the optimizer sees (a DTensor
    gradient is made whole, a collective); ``clip``: what ``clip_grad_norm_`` returned (the framework's own norm)."""
    import gradloc
    from tests.distributed.loop import whole

    ddp = builder(kwargs)
    if kwargs.get("compile"):
        ddp = torch.compile(ddp)  # the default backend (inductor); dynamo's DDPOptimizer splits at the buckets
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    x, y, w = data(rank)
    if rank == plant_rank:
        mb, b, t = PLANT[1:]
        w[HEALTHY, mb, b, t] = 3000.0
    mon = gradloc.watch(ddp, opt, store=False) if monitor else None
    out: dict[str, Any] = {"steps": [], "kind": mon.job.kind if mon else None}
    for s in range(STEPS):
        def loss_for(i: int, mask: torch.Tensor | None = None, s: int = s) -> torch.Tensor:
            logits = ddp(input_ids=x[s, i]).logits  # (B, T, V)
            terms = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y[s, i].reshape(-1),
                                                      reduction="none").view(B, SEQ) * w[s, i]  # (B·T,) -> (B, T)
            if mask is not None:
                terms = terms * mask
            return terms.sum() / (B * SEQ * M)

        t0 = time.perf_counter()
        total = torch.zeros(())
        for i in range(M):
            block = mon.micro_batch(y[s, i]) if mon is not None else contextlib.nullcontext()
            sync = i == M - 1 or kwargs.get("accumulate") == "sync"
            with (contextlib.nullcontext() if sync else ddp.no_sync()), block:
                loss = loss_for(i)
                loss.backward()
            total += loss.detach()
        delivered = math.sqrt(sum(float(whole(p.grad).double().pow(2).sum()) for p in ddp.parameters()
                                  if p.grad is not None))
        rep = mon.end_step(total, probe=loss_for) if mon is not None else None
        clip = float(whole(torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        if rep is not None:
            loc = rep.incident.localization if rep.incident is not None else None
            out["steps"].append({
                "seconds": time.perf_counter() - t0, "norm": rep.record.global_norm, "delivered": delivered,
                "clip": clip,
                "kinds": sorted(str(k) for k in rep.spike.kinds), "incident": rep.incident is not None,
                "scope": str(rep.incident.scope) if rep.incident is not None else None,
                "loc": None if loc is None else {
                    "status": str(loc.status), "level": str(loc.level), "probes": loc.probes, "note": loc.note,
                    "explained": loc.explained_share,
                    "culprits": [(c.rank, c.micro_batch, c.sample, c.position) for c in loc.culprits]}})
    if mon is not None:
        out["broken"] = mon.comm.broken if mon.comm is not None else ""
        mon.close()
    inner = getattr(ddp, "module", ddp)  # DDP's module (through torch.compile's wrapper); FSDP2: the model itself
    out["params"] = {n: whole(p).detach().clone() for n, p in inner.named_parameters()}
    out["placements"] = sorted({str(getattr(p, "placements", "whole")) for p in inner.parameters()})
    return out


def run_all(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    """Every variant in ``names``, with gradloc and without it; the plant on the last rank."""
    table = variants()
    res = {}
    for name in names:
        res[name] = {"with": train(rank, world, table[name], True, world - 1),
                     "without": train(rank, world, table[name], False, world - 1)}
    return res
