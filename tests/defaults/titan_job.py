"""torchtitan with its own default parallelism: ``ParallelismConfig()``'s ``data_parallel_shard_degree=-1`` and
every other degree 1 — FSDP2 over all ranks, applied by its own ``parallelize_llama`` — around its own Llama 3
(tests/titan.py), clipped by its own ``clip_grad_norm_`` at its default ``max_norm`` (1.0) after ``end_step``, as
its Trainer does. The CPU workarounds tests/titan.py documents stay (``partial_dtensor``, SUM reductions for
gloo, sdpa attention), and so do its float32 parameters and no activation checkpointing: two of its Trainer's
defaults not covered here (``mixed_precision_param`` is bfloat16, ``activation_checkpoint`` selective AC), as in
the tier's other torchtitan tests. Its default pipeline schedule (1F1B) runs in tests/distributed/test_pp.py.

The loop is tests/distributed/loop.py's (two micro-batches, the loss torchtitan's way: Σ ce / (B·T·M·dp)), the
default detector, the token planted ×3000 on the last rank after ``HEALTHY`` healthy steps; with gradloc and
without it (the bitwise check)."""
from __future__ import annotations

import time
from typing import Any

import torch

from tests import titan
from tests.distributed.loop import essentials, run_steps, token_losses, whole
from tests.distributed.titan_job import data

HEALTHY = 32
STEPS = HEALTHY + 2
PLANT = (1, 2, 5)  # (micro-batch, sample, position) on the last rank at step HEALTHY
MAX_NORM = 1.0  # torchtitan's TrainingConfig.max_norm default


def train(rank: int, world: int, monitor: bool) -> dict[str, Any]:
    from torchtitan.distributed.utils import clip_grad_norm_

    import gradloc

    dims = titan.parallel_dims(world)  # its defaults: dp_shard -1 (every rank), tp = pp = ep = 1
    model = titan.parallelize(titan.llama3(0, parallelism=titan.parallelism_config()), dims, "llama3")
    x, y, w = data(rank, STEPS)
    if rank == world - 1:
        w[(HEALTHY, *PLANT)] = 3000.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gradloc.watch(model, opt, store=False) if monitor else None
    clips: list[float] = []
    seconds: list[float] = []

    def timed_end_step(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        rep = mon.end_step(*a, **k)
        seconds.append(time.perf_counter() - t0)
        return rep

    def clip() -> None:
        clips.append(float(whole(clip_grad_norm_(list(model.parameters()), MAX_NORM))))

    reports, _ = run_steps(model, opt, mon, (x, y, w), STEPS, token_losses=token_losses, dp=dims.dp_shard,
                           end_step=timed_end_step if mon is not None else None, clip=clip)
    out = {"reports": [essentials(r) for r in reports], "clips": clips, "seconds": seconds,
           "params": {n: whole(p).detach().clone() for n, p in model.named_parameters()},
           "placements": sorted({str(p.placements) for p in model.parameters()}), "dp": dims.dp_shard}
    if mon is not None:
        out.update(kind=mon.job.kind, broken=mon.comm.broken if mon.comm is not None else "",
                   counters=dict(mon.counters))
        mon.close()
    return out


def run_both(rank: int, world: int) -> dict[str, Any]:
    return {"with": train(rank, world, True), "without": train(rank, world, False)}
