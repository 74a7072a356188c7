"""``python -m bench overhead --ddp N``: the overhead benchmark as N DDP ranks of one gloo job.

Every rank holds the same variants as ``bench overhead`` (plain, per-layer, per-token), each its own
``DistributedDataParallel`` copy of one seeded model with its own AdamW, and runs them interleaved
in a rotating order, every rank in the same order (DDP's all-reduces and gradloc's one all_gather
per step pair up across ranks). Each rank trains on its own random tokens. The micro-batches before
the last run under ``no_sync()``: one gradient all-reduce per step, as users run DDP. The ranks are
spawned by :func:`gradloc.demo.spawn.run_ranks` (gloo on CPU, one torch thread per rank).

Ratios are of median step times on each rank (rank 0's are the headline; all are in the JSON).
``updates_identical``: every gradloc variant's parameters equal plain's bitwise after the run.
"""
from __future__ import annotations

import copy
import os
import time
from dataclasses import replace
from typing import Any

from bench.overhead import OverheadConfig, _summarize, make_batches


def _rank(rank: int, world: int, cfg: OverheadConfig) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from bench.models import build_model
    from bench.variants import make_variant

    (kind,) = cfg.models
    mcfg, rounds = cfg.model(kind), cfg.rounds_for(kind)
    base = build_model(mcfg, cfg.seed)
    variants = []
    start = time.perf_counter()
    try:
        for name in cfg.variants:
            variants.append(make_variant(name, DistributedDataParallel(copy.deepcopy(base)), cfg.lr))
        at_attach = {v.name: v.mon.comm.collectives for v in variants if _comm(v) is not None}  # attach's own
        gen = torch.Generator().manual_seed(cfg.seed + 1 + 1000 * rank)  # each rank its own data
        for r in range(cfg.warmup + rounds):
            batches = make_batches(mcfg, gen, "cpu")
            k = r % len(variants)
            for v in variants[k:] + variants[:k]:
                v.step(batches, mcfg.tokens_per_step, record=r >= cfg.warmup)
    finally:
        for v in variants:
            v.close()
    res = _summarize(variants, mcfg, base, rounds, cfg.warmup)
    res["wall_s"] = round(time.perf_counter() - start, 1)
    res["collectives_per_step"] = {v.name: round((v.mon.comm.collectives - at_attach[v.name]) / (cfg.warmup + rounds), 3)
                                   for v in variants if _comm(v) is not None}
    res["job_kind"] = {v.name: v.mon.job.kind for v in variants if getattr(v, "mon", None) is not None}
    return res


def _comm(v: Any) -> Any:
    mon = getattr(v, "mon", None)
    return None if mon is None else mon.comm


def run_ddp_overhead(cfg: OverheadConfig, world: int, timeout_s: float = 3000.0) -> dict[str, Any]:
    """The DDP overhead run (``cfg.models`` must name one model); rank 0's summary plus every rank's."""
    from gradloc.demo.spawn import TRAINING_PRELOAD, run_ranks

    if len(cfg.models) != 1:
        cfg = replace(cfg, models=(cfg.models[0],))
    load_start, start = os.getloadavg()[0], time.perf_counter()
    ranks = run_ranks(_rank, world, cfg, timeout_s=timeout_s, paths=(os.getcwd(),),
                      preload=TRAINING_PRELOAD)
    import torch

    return {"ddp": {"world_size": world, "backend": "gloo", **ranks[0],
                    "ranks": [{k: r[k] for k in r if k.endswith("_ratio") or k in ("identical_to_plain", "wall_s")}
                              for r in ranks],
                    "updates_identical": all(r["updates_identical"] for r in ranks)},
            "torch_threads": 1, "torch_version": torch.__version__, "device": "cpu", "nproc": os.cpu_count(),
            "wall_s": round(time.perf_counter() - start, 1),
            "loadavg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)]}


def format_ddp(res: dict[str, Any]) -> str:
    d = res["ddp"]
    lines = [f"DDP, {d['world_size']} ranks (gloo, CPU): {d['model']} d_model {d['d_model']}, {d['n_layers']} layers, "
             f"{d['params']:,} params, {d['tokens_per_step']} tokens/step per rank, {d['rounds']} rounds "
             f"(+{d['warmup_rounds']} warm-up), {res['wall_s']} s, load average {res['loadavg_1m'][0]} -> "
             f"{res['loadavg_1m'][1]}",
             "rank  variant    step ms  ratio  paired  CPU-time"]
    for r, rank in enumerate(d["ranks"]):
        for name in ("per_layer", "per_token"):
            if f"{name}_ratio" in rank:
                ms = f"{d[f'{name}_step_ms']:.1f}" if r == 0 else "-"
                lines.append(f"{r:>4}  {name:<9}  {ms:>7}  {rank[f'{name}_ratio']:.3f}  "
                             f"{rank[f'paired_{name}_ratio']:.3f}   {rank[f'cpu_{name}_ratio']:.3f}")
    lines.append(f"plain step ms (rank 0): {d['plain_step_ms']:.1f}; gradloc collectives per step: "
                 f"{d['collectives_per_step']}; updates identical to plain on every rank: {d['updates_identical']}")
    return "\n".join(lines)
