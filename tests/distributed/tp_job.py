"""A small tensor-parallel job for the distributed tests: a Llama-shaped toy under DTensor's own TP styles.

The model is written the way TP needs (the heads come from the local width, so a column-parallel
q/k/v gives each rank its heads), with biases on the MLP (a row-parallel bias is replicated). ``plan``
is torch's ``parallelize_module`` plan: ``sp=True`` is torchtitan's (the embedding row-parallel into a
sequence shard, the norms ``SequenceParallel``, the projections column/row-parallel around them, the
head column-parallel back to replicated logits); ``sp=False`` keeps activations replicated. ``mesh``:
tp alone, or (dp, tp) with FSDP2 over dp (2D).

Data: each data rank r has its own micro-batches; the tp ranks of a data index see the same ones. The
loss of micro-batch i is Σ w·mask·ce / (B·T·M); FSDP averages over the data ranks. ``plant`` = (data rank,
step, micro-batch, sample, position) multiplies one token's loss weight by 3000 there.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, B, M, D, HEADS = 128, 16, 4, 2, 32, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(D), nn.RMSNorm(D)
        self.wq, self.wk, self.wv = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.wo = nn.Linear(D, D, bias=False)
        self.w1, self.w2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)  # (B, T, D/tp) each under TP
        Bq, T, width = q.shape
        hd = D // HEADS
        q, k, v = (t.view(Bq, T, width // hd, hd).transpose(1, 2) for t in (q, k, v))  # (B, H/tp, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(Bq, T, width)  # (B, H/tp, T, hd) -> (B, T, D/tp)
        x = x + self.wo(y)
        return x + self.w2(F.silu(self.w1(self.norm2(x))))


class Toy(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.RMSNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))  # (B, T, V)


def plan(sp: bool) -> tuple[dict, dict]:
    """(top-level plan, per-block plan) of torch's TP styles; ``sp``: sequence-sharded activations."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sp else Replicate()
    top = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    block = {n: ColwiseParallel(input_layouts=seq) for n in ("wq", "wk", "wv", "w1")}  # gathered under SP
    block.update(wo=RowwiseParallel(output_layouts=seq), w2=RowwiseParallel(output_layouts=seq))
    if sp:
        top["norm"] = SequenceParallel()
        block.update(norm1=SequenceParallel(), norm2=SequenceParallel())
    return top, block


def build(world: int, tp: int, sp: bool, seed: int = 0) -> tuple[nn.Module, Any]:
    """The toy under TP (and FSDP2 over the data dim when world > tp), and its mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = Toy(seed)
    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")) if dp > 1 else \
        init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    top, block = plan(sp)
    parallelize_module(model, mesh["tp"], top)
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], block)
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def data(dp_rank: int, steps: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000 * dp_rank)
    tokens = torch.randint(VOCAB, (steps, M, B, SEQ + 1), generator=g)
    return tokens[..., :-1].clone(), tokens[..., 1:].clone(), torch.ones(steps, M, B, SEQ)


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    Bl, T, V = logits.shape
    return F.cross_entropy(logits.reshape(Bl * T, V).float(), targets.reshape(Bl * T), reduction="none").view(Bl, T)


__all__ = ["Toy", "build", "data", "token_losses", "B", "D", "M", "SEQ", "VOCAB"]


def train(rank: int, world: int, tp: int, sp: bool, steps: int, plant: tuple | None = None,
          monitor: bool = True, invariants: bool = False, **watch: Any) -> dict[str, Any]:
    """Train ``steps`` AdamW steps; returns the reports' essentials, the final parameters (whole) and, on the
    first step, the per-layer gradient norms a placement-aware reduction gives (torchtitan's way)."""
    import gradloc

    model, mesh = build(world, tp, sp)
    dp_rank = rank // tp  # the mesh is (dp, tp), row-major
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y, w = data(dp_rank, steps)
    if plant is not None and plant[0] == dp_rank:
        _, s, mb, b, t = plant
        w[s, mb, b, t] = 3000.0
    mon = gradloc.watch(model, opt, store=False, detector=gradloc.DetectorConfig(warmup=5), **watch) \
        if monitor else None
    from tests.distributed.invariants import Watch

    inv = Watch(mon) if invariants and mon is not None else None
    out: dict[str, Any] = {"reports": [], "collectives": []}
    for s in range(steps):
        def loss_for(i: int, mask: torch.Tensor | None = None, s: int = s) -> torch.Tensor:
            terms = token_losses(model(x[s, i]), y[s, i]) * w[s, i]
            if mask is not None:
                terms = terms * mask
            return terms.sum() / (terms.numel() * M)

        total = torch.zeros(())
        for i in range(M):
            if mon is not None:
                with mon.micro_batch(y[s, i]):
                    loss = loss_for(i)
                    loss.backward()
            else:
                loss = loss_for(i)
                loss.backward()
            total += loss.detach()
        if s == 0:
            out["norms"] = {n: float(_whole(p.grad).double().norm()) for n, p in model.named_parameters()}
        if mon is not None:
            before = mon.comm.collectives
            rep = (inv.end_step if inv is not None else mon.end_step)(total, probe=loss_for)
            out["collectives"].append(mon.comm.collectives - before)
            rec = rep.record
            loc = rep.incident.localization if rep.incident is not None else None
            out["reports"].append({
                "step": rec.step, "norm": rec.global_norm, "layers": {ls.layer: ls.grad_norm for ls in rec.layers},
                "top": [(t.micro_batch, t.sample, t.position, t.score) for t in (rec.tokens.top if rec.tokens else ())],
                "unattributed": rec.tokens.unattributed_share if rec.tokens else None,
                "kinds": sorted(rep.spike.kinds) if rep.incident else [],
                "loc": None if loc is None else {
                    "status": str(loc.status), "level": str(loc.level), "probes": loc.probes, "note": loc.note,
                    "explained": loc.explained_share,
                    "culprits": [(c.rank, c.micro_batch, c.sample, c.position) for c in loc.culprits]}})
        opt.step()
        opt.zero_grad()
    out["params"] = {n: _whole(p).detach().clone() for n, p in model.named_parameters()}
    if inv is not None:
        out["steps"], out["trace"] = inv.steps, list(mon.comm.state.trace)
    if mon is not None:
        out["counters"] = dict(mon.counters)
        mon.close()
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


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
