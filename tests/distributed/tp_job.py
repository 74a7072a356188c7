"""A small tensor-parallel job for the distributed tests: the demo's Llama-shaped ParallelGPT under DTensor's own
TP styles (gradloc/demo/parallel.py: the heads come from the local width, biases on the MLP, whose row-parallel
bias is replicated). ``sp=True`` is torchtitan's plan (the embedding row-parallel into a sequence shard, the
norms ``SequenceParallel``, the projections column/row-parallel around them, the head column-parallel back to
replicated logits); ``sp=False`` keeps activations replicated. Tp alone, or (dp, tp) with FSDP2 over dp (2D).

Data: each data rank r has its own micro-batches; the tp ranks of a data index see the same ones. The
loss of micro-batch i is Σ w·mask·ce / (B·T·M); FSDP averages over the data ranks. ``plant`` = (data rank,
step, micro-batch, sample, position) multiplies one token's loss weight by 3000 there.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.distributed.loop import essentials, prepare, run_steps, token_losses, whole

VOCAB, SEQ, B, M, D, HEADS = 128, 16, 4, 2, 32, 4


def Toy(seed: int = 0) -> nn.Module:  # noqa: N802
    """The toy: the demo's ParallelGPT (gradloc/demo/parallel.py), small."""
    from gradloc.demo.parallel import ParallelGPT

    return ParallelGPT(VOCAB, D, 2, HEADS, seed=seed)


def build(world: int, tp: int, sp: bool, seed: int = 0) -> tuple[nn.Module, Any]:
    """The toy under TP (torch's styles, the demo's plan), FSDP2 over the data dim when world > tp."""
    from gradloc.demo.parallel import tensor_parallel

    return tensor_parallel(Toy(seed), world, "fsdp", sp=sp, tp=tp), None


def data(dp_rank: int, steps: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000 * dp_rank)
    tokens = torch.randint(VOCAB, (steps, M, B, SEQ + 1), generator=g)
    return tokens[..., :-1].clone(), tokens[..., 1:].clone(), torch.ones(steps, M, B, SEQ)


__all__ = ["Toy", "build", "data", "token_losses", "B", "D", "M", "SEQ", "VOCAB"]


def train(rank: int, world: int, tp: int, sp: bool, steps: int, plant: tuple | None = None,
          monitor: bool = True, invariants: bool = False, **watch: Any) -> dict[str, Any]:
    """Train ``steps`` AdamW steps; returns the reports' essentials, the final parameters (whole) and, on the
    first step, the per-layer gradient norms a placement-aware reduction gives (torchtitan's way)."""

    model, mesh = build(world, tp, sp)
    dp_rank = rank // tp  # the mesh is (dp, tp), row-major
    x, y, w = data(dp_rank, steps)
    opt, mon, inv = prepare(model, (x, y, w), plant, dp_rank, monitor, invariants, watch)
    out: dict[str, Any] = {}

    def norms() -> None:
        out["norms"] = {n: float(whole(p.grad).double().norm()) for n, p in model.named_parameters()}

    reports, out["collectives"] = run_steps(model, opt, mon, (x, y, w), steps, token_losses=token_losses,
                                            end_step=inv.end_step if inv is not None else None,
                                            after_first_backward=norms)
    out["reports"] = [essentials(r) for r in reports]
    out["params"] = {n: whole(p).detach().clone() for n, p in model.named_parameters()}
    if inv is not None:
        out["steps"], out["trace"] = inv.steps, list(mon.comm.state.trace)
    if mon is not None:
        out["counters"] = dict(mon.counters)
        mon.close()
    return out


def reference(steps: int, dp: int, plant: tuple | None = None) -> dict[str, Any]:
    """The same toy in one process: the first step's per-parameter gradient norms of the job's loss (the mean
    over the data ranks), and gradloc's top tokens of data rank 0's own micro-batches (the scores a rank
    computes are of its own loss, before any data-parallel averaging)."""
    import gradloc

    out: dict[str, Any] = {}
    model = Toy()
    for r in range(dp):
        x, y, w = data(r, steps)
        for i in range(M):
            (token_losses(model(x[0, i]), y[0, i]) * w[0, i]).sum().div(B * SEQ * M * dp).backward()
    out["norms"] = {n: float(p.grad.double().norm()) for n, p in model.named_parameters()}
    model = Toy()
    x, y, w = data(0, steps)
    mon = gradloc.watch(model, store=False)
    for i in range(M):
        with mon.micro_batch(y[0, i]):
            (token_losses(model(x[0, i]), y[0, i]) * w[0, i]).sum().div(B * SEQ * M).backward()
    rec = mon.end_step(None).record
    out["top"] = [(t.micro_batch, t.sample, t.position, t.score) for t in rec.tokens.top]
    out["layers"] = {ls.layer: ls.grad_norm for ls in rec.layers}
    mon.close()
    return out
