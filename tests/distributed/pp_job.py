"""Pipeline-parallel jobs for the distributed tests (2 stages, ``torch.distributed.pipelining``).

- ``titan``: torchtitan's own Llama 3 split by its own ``pipeline_llm`` (its stages, its FSDP2 over the
  data dim, "alone" on a data group of one), run by a torch schedule (``ScheduleGPipe`` / ``Schedule1F1B``)
  whose loss is ours: the per-token loss weights travel in the target, so a culprit can be planted.
- ``toy``: the demo's ParallelGPT cut by hand in two stages (gradloc/demo/parallel.Half), each stage's module
  under FSDP2 over its data group (4 processes: dp 2 × pp 2). Not DDP: under pipelining, DDP runs only with
  ``static_graph=True`` (its first-step bucket rebuild fails otherwise) and then does not produce the data
  ranks' mean (measured: ‖∇‖ 0.836 where the mean's is 0.620; PP alone matches exactly) — PyTorch's
  pipelining integrates FSDP2, as torchtitan uses it.

The rank layout is pp-major (ranks 0..dp-1 hold stage 0): torchtitan's mesh order, and the toy's. Micro-batches
are the schedule's: each rank's batch of B rows split in ``M`` chunks along dim 0. A micro-batch's per-token
loss is w · ce / (B·T·dp) (every chunk of every data rank: the mean over the job's tokens); the schedule sums
the chunks' losses (``scale_grads=False``) and FSDP2 averages the data ranks (the toy's loss is not divided by
dp; torchtitan's sums: its loss is).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests import titan

SEQ, B, M = 16, 4, 4


def data(dp_rank: int, steps: int, vocab: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000 * dp_rank)
    tokens = torch.randint(vocab, (steps, B, SEQ + 1), generator=g)
    return tokens[..., :-1].clone(), tokens[..., 1:].clone()


def _target(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.stack([y.double(), w.double()], dim=-1)  # (B, T) ids and (B, T) weights -> (B, T, 2)


class TokenLoss:
    """(stage output (B, T, V), target (B, T, 2)) -> (B, T) per-token terms w · ce · scale: the schedule's loss is
    their sum."""

    def __init__(self, scale: float) -> None:
        self.scale, self.die = scale, False

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.die:
            import os

            os._exit(3)  # a stage dying in the middle of a probe
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        ids, w = target[..., 0].long(), target[..., 1].float()
        Bl, T, V = out.shape
        ce = F.cross_entropy(out.reshape(Bl * T, V).float(), ids.reshape(Bl * T), reduction="none").view(Bl, T)
        return ce * w * self.scale


def _titan_stage(world: int, dp: int, schedule: str) -> tuple[Any, nn.Module, Any]:
    dims = titan.parallel_dims(world, dp_shard=dp, pp=2)
    model = titan.llama3(0, parallelism=titan.parallelism_config(dp_shard=dp, pp=2, schedule=schedule))
    _, stage, part = titan.pipeline(model, dims, schedule=schedule, local_batch=B)
    return stage, part, dims


class _Half(nn.Module):
    """One half of the toy: the embedding and first block (stage 0) or the last block, norm and head (stage 1)."""

    def __init__(self, toy: nn.Module, first: bool) -> None:
        super().__init__()
        self.first = first
        if first:
            self.tok, self.layers = toy.tok, nn.ModuleList([toy.layers[0]])
        else:
            self.layers, self.norm, self.head = nn.ModuleList([toy.layers[1]]), toy.norm, toy.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) if self.first else x
        for layer in self.layers:
            h = layer(h)
        return h if self.first else self.head(self.norm(h))


def _toy_stage(rank: int, world: int, dp: int) -> tuple[Any, nn.Module, Any]:
    """The toy's stage for this rank: pp-major ranks (0..dp-1: stage 0), FSDP2 over the stage's data group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    from gradloc.demo.parallel import Half, ParallelGPT

    mesh = init_device_mesh("cpu", (2, dp), mesh_dim_names=("pp", "dp"))
    part: nn.Module = Half(ParallelGPT(128, 32, 2, 4, seed=0), rank // dp == 0)
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(part, mesh=mesh["dp"])
    return PipelineStage(part, rank // dp, 2, torch.device("cpu"), group=mesh["pp"].get_group()), part, None


def train(rank: int, world: int, model: str, schedule: str, steps: int, plant: tuple | None = None,
          monitor: bool = True, invariants: bool = False, die: tuple[int, int] | None = None,
          **watch: Any) -> dict[str, Any]:
    """``die`` = (rank, step): that rank exits inside the step's first probe (a stage dying mid-probe)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    import gradloc

    dp = world // 2
    if model == "titan":
        stage, part, dims = _titan_stage(world, dp, schedule)
        vocab, scale = titan.VOCAB, 1.0 / (B * SEQ * dp)
    else:
        stage, part, dims = _toy_stage(rank, world, dp)
        vocab, scale = 128, 1.0 / (B * SEQ)
    dp_rank = rank % dp
    token_loss = TokenLoss(scale)
    sched = (ScheduleGPipe if schedule == "GPipe" else Schedule1F1B)(
        stage, M, loss_fn=lambda out, tgt: token_loss(out, tgt).sum(), scale_grads=False)
    opt = torch.optim.AdamW(part.parameters(), lr=1e-3)
    x, y = data(dp_rank, steps, vocab)
    w = torch.ones(steps, B, SEQ)
    if plant is not None and plant[0] == dp_rank:
        _, s, b, t = plant
        w[s, b, t] = 3000.0
    emitted = Emitted()
    mon = gradloc.watch(stage, opt, store=False, detector=gradloc.DetectorConfig(warmup=5), sinks=[emitted],
                        **watch) if monitor else None
    from tests.distributed.invariants import Watch

    inv = Watch(mon) if invariants and mon is not None else None
    out: dict[str, Any] = {"reports": [], "stage": stage.stage_index}
    for s in range(steps):
        target = _target(y[s], w[s])
        if mon is not None:
            losses = mon.pipeline_step(sched, inputs=x[s], target=target, token_ids=y[s], token_loss=token_loss)
        else:
            losses = []
            args = (x[s],) if stage.is_first else ()
            sched.step(*args, **({"target": target, "losses": losses} if stage.is_last else {}))
        if s == 0:  # the job's norm, placement-aware: torchtitan's own; the toy's shards are disjoint (FSDP2, stages)
            out["ref_norm"] = float(titan.grad_norm(part, dims)) if dims is not None else _shards_norm(part)
        if die is not None and die == (rank, s):
            token_loss.die = True  # its next call is the probe's, on this (last) stage
        if mon is not None:
            rep = (inv.end_step if inv is not None else mon.end_step)(torch.stack(losses).sum() if losses else None)
            rec = rep.record
            loc = rep.incident.localization if rep.incident is not None else None
            if die is not None and s == die[1]:
                out["dead_peer"] = {"status": str(rep.incident.localization.status),
                                    "note": rep.incident.localization.note, "left": mon.comm is None}
                return out  # the peer is dead: the job's own next collective would wait on it, not gradloc
            out["reports"].append({
                "norm": rec.global_norm, "layers": {ls.layer: ls.grad_norm for ls in rec.layers},
                "unattributed": rec.tokens.unattributed_share if rec.tokens else None,
                "top": [(t.micro_batch, t.sample, t.position, t.score) for t in (rec.tokens.top if rec.tokens else ())],
                "incidents": 1 if rep.incident is not None else 0,
                "loc": None if loc is None else {
                    "status": str(loc.status), "probes": loc.probes, "note": loc.note,
                    "culprits": [(c.rank, c.micro_batch, c.sample, c.position) for c in loc.culprits]}})
        opt.step()
        opt.zero_grad()
    out["params"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                     for n, p in part.named_parameters()}
    if inv is not None:
        out["steps"], out["trace"] = inv.steps, list(mon.comm.state.trace)
    if mon is not None:
        out["counters"] = dict(mon.counters)
        out["surprise"] = [float(v) for v in mon.samples.judge.mean.values[: mon.samples.judge.mean.n]]  # judged samples
        out["emitted"] = emitted.incidents
        out["own_layers"] = len(mon.layer_stats.local_layers)
        mon.close()
    return out


def _shards_norm(part: nn.Module) -> float:
    import torch.distributed as dist

    sq = torch.tensor([sum(float((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).double().pow(2).sum())
                           for p in part.parameters() if p.grad is not None)], dtype=torch.float64)
    dist.all_reduce(sq)
    return float(sq) ** 0.5


class Emitted:
    """A sink counting the incidents this rank emits (a job's incident is emitted once, by rank 0)."""

    def __init__(self) -> None:
        self.incidents = 0

    def on_step(self, record: Any) -> None:
        pass

    def on_incident(self, incident: Any) -> None:
        self.incidents += 1

    def force_flush(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def train_both(rank: int, world: int, model: str, schedule: str, steps: int, plant: tuple | None = None) -> dict:
    plain = train(rank, world, model, schedule, steps, plant, monitor=False)
    watched = train(rank, world, model, schedule, steps, plant)
    watched["bitwise"] = all(torch.equal(plain["params"][n], watched["params"][n]) for n in plain["params"])
    del watched["params"]
    return watched


def reference_top(model: str, world: int, steps: int) -> list[tuple]:
    """gradloc's top tokens of data rank 0's first step on the same model unsplit, in one process: its chunks as
    micro-batches, each chunk's loss scaled as a rank's (``train``: the scores are of the rank's own loss). What
    its stages' step-0 scores must equal."""
    import gradloc
    from gradloc.demo.parallel import ParallelGPT

    dp = world // 2
    net = titan.llama3(0) if model == "titan" else ParallelGPT(128, 32, 2, 4, seed=0)
    vocab, scale = (titan.VOCAB, 1.0 / (B * SEQ * dp)) if model == "titan" else (128, 1.0 / (B * SEQ))
    x, y = data(0, steps, vocab)
    target = _target(y[0], torch.ones(B, SEQ))
    token_loss = TokenLoss(scale)
    mon = gradloc.watch(net, store=False)
    for xs, ts, ys in zip(x[0].chunk(M), target.chunk(M), y[0].chunk(M)):  # (B, T) -> M × (B/M, T)
        with mon.micro_batch(ys):
            token_loss(net(xs), ts).sum().backward()
    rec = mon.end_step(None).record
    mon.close()
    return [(t.micro_batch, t.sample, t.position, t.score) for t in rec.tokens.top]


def reference_surprise(steps: int, **watch: Any) -> list[float]:
    """The judged samples' mean surprise (in judging order) of the toy unsplit in one process, trained as a 2-stage
    job's data rank 0 (its chunks as micro-batches, the same loss and AdamW): what the last stage must judge."""
    import gradloc
    from gradloc.demo.parallel import ParallelGPT

    net = ParallelGPT(128, 32, 2, 4, seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = data(0, steps, 128)
    token_loss = TokenLoss(1.0 / (B * SEQ))
    mon = gradloc.watch(net, opt, store=False, **watch)
    for s in range(steps):
        target = _target(y[s], torch.ones(B, SEQ))
        for xs, ts, ys in zip(x[s].chunk(M), target.chunk(M), y[s].chunk(M)):  # (B, T) -> M × (B/M, T)
            with mon.micro_batch(ys):
                token_loss(net(xs), ts).sum().backward()
        mon.end_step(None)
        opt.step()
        opt.zero_grad()
    got = [float(v) for v in mon.samples.judge.mean.values[: mon.samples.judge.mean.n]]
    mon.close()
    return got
