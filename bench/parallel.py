"""``python -m bench overhead --parallel fsdp-tp|pp``: the overhead benchmark as 4 ranks of a model-parallel gloo job.

- ``fsdp-tp``: the demo's ParallelGPT (gradloc/demo/parallel.py) under DTensor tensor + sequence parallelism on a
  (dp 2, tp 2) mesh, FSDP2 over dp;
- ``pp``: the same model in 2 pipeline stages × FSDP2 over dp 2, micro-batches through a GPipe schedule
  (``mon.pipeline_step`` for the gradloc variants, ``schedule.step`` for plain).

Every variant's step is torchtitan's: forward + backward (gradloc's ``end_step`` after it), then
``torchtitan.distributed.utils.clip_grad_norm_(max_norm=1.0)`` — its norm is reduced over dp/tp by DTensor and over the
pipeline's stages by an all-reduce (``pp_mesh``), so a plain PP job lines its stages up before the optimizer step
anyway — then ``optimizer.step()``. ``--no-clip`` leaves the clipping out (the figures measured before it was added).

Every rank holds the variants (plain, per-layer, per-token), each its own parallelized copy of one seeded model
with its own AdamW, run interleaved in a rotating order, the same on every rank (the variants' collectives pair
up). The tp/pp ranks of a data index train on the same random tokens, each data rank on its own. Every step starts
after a barrier (not timed), so no variant inherits another's stragglers. ``job_ratios``: of the median *job* step
time (the slowest rank's time of each step: what a synchronous job waits for; under PP, where a rank's own step
boundaries shift with the schedule, the number to read); ``job_paired``: the median of the per-step ratios of the job's
step, with ``job_paired_ci95`` its distribution-free 95 % interval (:func:`median_ci`); ``ranks``: of each rank's own median; ``rank_phases_ms``:
each rank's median forward + backward, ``end_step``, clipping and optimizer step (with ``zero_grad``). ``collectives_per_step`` counts gradloc's own (``mon.comm.collectives``) per
healthy step; ``updates_identical``: every gradloc variant's parameters (made whole) equal plain's bitwise.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from bench.overhead import OverheadConfig

MODES = ("fsdp-tp", "pp")
WORLD = 4
CLIP = 1.0  # torchtitan's default max_norm


class _Variant:
    def __init__(self, name: str, mode: str, rank: int, cfg: Any, clip: float | None) -> None:
        import gradloc
        from gradloc.demo.parallel import ParallelGPT, pipeline_stage, tensor_parallel

        self.name, self.mode, self.clip = name, mode, clip
        model = ParallelGPT(cfg.vocab, cfg.d_model, cfg.n_layers, cfg.n_heads, seed=0)
        self.pp_mesh = None
        if mode == "pp":
            self.stage, self.part, mesh = pipeline_stage(model, rank, WORLD)
            self.pp_mesh = mesh["pp"]
            target: Any = self.stage
        else:
            self.stage, self.part = None, tensor_parallel(model, WORLD, "fsdp")
            target = self.part
        self.opt = torch.optim.AdamW(self.part.parameters(), lr=1e-3)
        self.mon = None
        if name != "plain":
            fields = {"token_stats": False} if name == "per_layer" else {}
            self.mon = gradloc.watch(target, self.opt, store=False, **fields)
        self.schedule = None
        if mode == "pp":
            from torch.distributed.pipelining import ScheduleGPipe

            self.schedule = ScheduleGPipe(self.stage, cfg.micro_batches, loss_fn=lambda o, t: _loss(o, t).sum(),
                                          scale_grads=False)
        self.step_s: list[float] = []  # this rank's step times
        self.job_s: list[float] = []  # the job's: the slowest rank's time of the same step
        self.phases: list[tuple[float, ...]] = []  # (forward + backward, end_step, clip, optimizer) per step
        self.before = self.mon.comm.collectives if self.mon is not None else 0

    def step(self, batches: list, record: bool) -> None:
        torch.distributed.barrier()  # every variant's step starts together on every rank (not timed)
        t0 = time.perf_counter()
        if self.mode == "pp":
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])  # M × (B, T) -> (M·B, T)
            if self.mon is not None:
                losses = self.mon.pipeline_step(self.schedule, inputs=x, target=y, token_loss=_loss)
                t1 = time.perf_counter()
                self.mon.end_step(torch.stack(losses).sum() if losses else None)
            else:
                kw = {"target": y, "losses": []} if self.stage.is_last else {}
                self.schedule.step(*((x,) if self.stage.is_first else ()), **kw)
                t1 = time.perf_counter()
        else:
            total = torch.zeros(())
            for x, y in batches:
                block = self.mon.micro_batch(y) if self.mon is not None else _Null()
                with block:
                    loss = _loss(self.part(x), y).sum()
                    loss.backward()
                total += loss.detach()
            t1 = time.perf_counter()
            if self.mon is not None:
                self.mon.end_step(total)
        t2 = time.perf_counter()
        if self.clip is not None:  # torchtitan's step: the norm over every stage (an all-reduce over pp), then clip
            from torchtitan.distributed.utils import clip_grad_norm_

            clip_grad_norm_(list(self.part.parameters()), self.clip, pp_mesh=self.pp_mesh)
        t3 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        elapsed = t4 - t0
        if record:
            self.step_s.append(elapsed)
            self.phases.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))  # forward + backward, end_step, clip, optimizer
            slowest = torch.tensor([elapsed], dtype=torch.float64)  # the job's step: its slowest rank (not timed)
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
            self.job_s.append(float(slowest))

    def params(self) -> list[torch.Tensor]:
        return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in self.part.parameters()]


def median_ci(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free ~95 % confidence interval of the median of ``values``: the order statistics
    ⌊n/2 − z·√n/2⌋ and ⌈n/2 + z·√n/2⌉ (1-based; the binomial's normal approximation), clamped to the sample. What
    a run's paired ratio can be told apart from: on this oversubscribed machine a step's time swings by a few %,
    more than the 2 % per-layer target, so the bench says how far its own median may be off."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_ci of no values")
    half = z * n ** 0.5 / 2
    lo, hi = max(math.floor(n / 2 - half), 1), min(math.ceil(n / 2 + half), n)  # 1-based ranks
    return xs[lo - 1], xs[hi - 1]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    B, T, V = out.shape
    return torch.nn.functional.cross_entropy(out.reshape(B * T, V).float(), y.reshape(B * T),
                                             reduction="none").view(B, T) / (B * T)  # (B, T) terms


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def _rank(rank: int, world: int, mode: str, cfg: OverheadConfig, clip: float | None) -> dict[str, Any]:
    from gradloc.demo.parallel import data_rank

    mcfg = cfg.model(cfg.models[0])
    rounds = cfg.rounds_for(cfg.models[0])
    names = ("plain", "per_layer", "per_token")
    variants = [_Variant(n, mode, rank, mcfg, clip) for n in names]
    gen = torch.Generator().manual_seed(cfg.seed + 1000 * data_rank("pp" if mode == "pp" else "tp", rank, world))
    start = time.perf_counter()
    try:
        for r in range(cfg.warmup + rounds):
            tokens = torch.randint(mcfg.vocab, (mcfg.micro_batches, mcfg.batch, mcfg.seq + 1), generator=gen)
            batches = [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(mcfg.micro_batches)]  # (B, T+1) -> 2×(B, T)
            k = r % len(variants)
            for v in variants[k:] + variants[:k]:
                v.step(batches, record=r >= cfg.warmup)
        plain = variants[0].params()
        identical = {v.name: all(torch.equal(a, b) for a, b in zip(plain, v.params())) for v in variants[1:]}
    finally:
        for v in variants:
            if v.mon is not None:
                v.mon.close()
    med = {v.name: statistics.median(v.step_s) for v in variants}
    job = {v.name: statistics.median(v.job_s) for v in variants}
    steps = cfg.warmup + rounds
    return {"job_ratios": {v.name: round(job[v.name] / job["plain"], 4) for v in variants[1:]},
            "job_paired": {v.name: round(statistics.median(a / b for a, b in zip(v.job_s, variants[0].job_s)), 4)
                           for v in variants[1:]},
            "job_paired_ci95": {v.name: [round(c, 4) for c in median_ci([a / b for a, b in zip(v.job_s, variants[0].job_s)])]
                                for v in variants[1:]},
            "job_step_ms": {v.name: round(1000 * job[v.name], 2) for v in variants},
            "ratios": {v.name: round(med[v.name] / med["plain"], 4) for v in variants[1:]},
            "paired": {v.name: round(statistics.median(a / b for a, b in zip(v.step_s, variants[0].step_s)), 4)
                       for v in variants[1:]},
            "step_ms": {v.name: round(1000 * med[v.name], 2) for v in variants},
            "phases_ms": {v.name: [round(1000 * statistics.median(p[i] for p in v.phases), 1) for i in range(4)]
                          for v in variants},  # this rank's medians: forward + backward, end_step, clip, optimizer
            "collectives_per_step": {v.name: round((v.mon.comm.collectives - v.before) / steps, 3)
                                     for v in variants[1:]},
            "updates_identical": identical, "wall_s": round(time.perf_counter() - start, 1),
            "model": {"d_model": mcfg.d_model, "n_layers": mcfg.n_layers, "vocab": mcfg.vocab, "batch": mcfg.batch,
                      "seq": mcfg.seq, "micro_batches": mcfg.micro_batches, "rounds": rounds, "warmup": cfg.warmup}}


def run_parallel_overhead(cfg: OverheadConfig, mode: str, timeout_s: float = 3000.0,
                          clip: float | None = CLIP) -> dict[str, Any]:
    """``clip``: every variant clips as torchtitan's trainer does (None: no clipping, the runs before clipping)."""
    from gradloc.demo.spawn import TRAINING_PRELOAD, run_ranks

    if mode not in MODES:
        raise ValueError(f"--parallel must be one of {MODES}")
    if clip is not None:
        try:
            import torchtitan.distributed.utils  # noqa: F401
        except ImportError as e:
            raise ValueError("--parallel clips with torchtitan's clip_grad_norm_: install the titan test extra "
                             "(scripts/setup.sh), or pass --no-clip") from e
    cfg = replace(cfg, models=(cfg.models[0],))
    load_start, start = os.getloadavg()[0], time.perf_counter()
    ranks = run_ranks(_rank, WORLD, mode, cfg, clip, timeout_s=timeout_s, paths=(os.getcwd(),),
                      preload=TRAINING_PRELOAD)
    return {"parallel": {"mode": mode, "world_size": WORLD, "clip": clip, **ranks[0], "ranks": [r["ratios"] for r in ranks],
                         "rank_phases_ms": [r["phases_ms"] for r in ranks],
                         "updates_identical": all(all(r["updates_identical"].values()) for r in ranks)},
            "torch_threads": 1, "torch_version": torch.__version__, "nproc": os.cpu_count(),
            "wall_s": round(time.perf_counter() - start, 1), "loadavg_1m": [round(load_start, 2),
                                                                            round(os.getloadavg()[0], 2)]}


def format_parallel(res: dict[str, Any]) -> str:
    p = res["parallel"]
    m = p["model"]
    clip = f"clip_grad_norm_ {p['clip']}" if p["clip"] is not None else "no clipping"
    lines = [f"{p['mode']}, {p['world_size']} ranks (gloo, CPU), {clip}: ParallelGPT d_model {m['d_model']}, {m['n_layers']} "
             f"layers, {m['micro_batches']} micro-batches of {m['batch']} × {m['seq']} per data rank, {m['rounds']} "
             f"rounds (+{m['warmup']}), {res['wall_s']} s, load average {res['loadavg_1m'][0]} -> {res['loadavg_1m'][1]}",
             "job (slowest rank per step): " + ", ".join(
                 f"{n} {x:.3f} (paired {p['job_paired'][n]:.3f}, 95 % CI {p['job_paired_ci95'][n][0]:.3f}–"
                 f"{p['job_paired_ci95'][n][1]:.3f})" for n, x in p["job_ratios"].items()),
             "rank  variant    ratio  (paired on rank 0)"]
    for r, ratios in enumerate(p["ranks"]):
        for name, x in ratios.items():
            paired = f"  ({p['paired'][name]:.3f})" if r == 0 else ""
            lines.append(f"{r:>4}  {name:<9}  {x:.3f}{paired}")
    lines.append(f"plain step ms (rank 0): {p['step_ms']['plain']}; gradloc collectives per step: "
                 f"{p['collectives_per_step']}; updates identical to plain on every rank: {p['updates_identical']}")
    return "\n".join(lines)
