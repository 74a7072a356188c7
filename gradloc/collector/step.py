"""Assemble one optimizer step's measurements into a :class:`StepRecord` with one host transfer.

Packed layout (float64): a ``packs.Pack`` of the fields present this step, in this order: the layer pack, the
GradScaler scale, the loss (a tensor), the token summary, the RL pack, the per-sample surprise pack, the token
group's check, the previous step's update sums, every rank's job row, the groups' tokens, the precursor slots and,
in a multi-rank job, every rank's RL entropy / KL sums (rl_fields.JOB_RL) and precursor row. In a multi-rank job one
collective precedes the transfer (collector/job.py); on one rank there is none.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from gradloc.collector.job import Gather, JobView, gather_step, job_vector, job_view
from gradloc.collector.layer_stats import LayerStatsCollector
from gradloc.collector.packs import Pack, layer_pack, summed_update_pack
from gradloc.collector.rl_fields import job_rl, job_rl_row, unpack_rl
from gradloc.collector.token_summary import StepScores, summary_layout, summary_pack, unpack_summary
from gradloc.records import StepRecord


@dataclass(frozen=True)
class StepInputs:
    step: int
    job: str
    rank: int
    micro_batches: int
    loss: float | torch.Tensor | None
    scale: torch.Tensor | None  # GradScaler scale the gradients were produced with
    unscaled_already: bool  # scaler.unscale_(optimizer) ran before end_step
    scores: StepScores | None
    token_layers: tuple[str, ...]
    top_k: int
    previous_update: torch.Tensor | None  # (3L,) [Σ‖Δθ‖² | Σ‖θ‖² | elements] of the previous step's window
    unattributed: tuple[int, ...] = ()  # covered parameters whose module went unscored this step
    rl: torch.Tensor | None = None  # the step's RL distributions pack (collector.rl_fields.rl_pack)
    comm: Gather | None = None  # a multi-rank job: one all_gather per step (collector/job.py)
    samples: torch.Tensor | None = None  # the per-sample surprise pack (collector/surprise.py)
    score_weight: float = 1.0  # this rank's share of the job's token scores (1 / its token group's ranks)
    group_tokens: torch.Tensor | None = None  # (S,) loss tokens per sample, when the step has groups (collector/groups.py)
    # the step's precursor slots and their pack (collector/precursors/slots.py: StepSlots.take), when measured
    precursors: tuple[tuple, torch.Tensor | None] | None = None
    precursor_row: torch.Tensor | None = None  # this rank's part of the step gather (collector/precursors/job.py)


@dataclass(frozen=True)
class Assembled:
    record: StepRecord
    previous_update: np.ndarray | None  # (3L,) host copy of StepInputs.previous_update (the job's, when sharded)
    scale: float  # host GradScaler scale (1.0 without a scaler)
    job: JobView | None = None  # a multi-rank job's step, identical on every rank
    samples: np.ndarray | None = None  # host copy of StepInputs.samples
    check: list[float] | None = None  # host copy of the token group's check (parallel/tokens.py)
    group_tokens: np.ndarray | None = None  # host copy of StepInputs.group_tokens
    precursors: np.ndarray | None = None  # host copy of StepInputs.precursors' pack
    precursor_rows: np.ndarray | None = None  # (W, n) host copy of every rank's StepInputs.precursor_row
    rl_job: tuple[float | None, float | None] | None = None  # a job's policy entropy and KL (rl_fields.job_rl)


def assemble(layers: LayerStatsCollector, x: StepInputs) -> Assembled:
    dev = layers.device
    if x.scale is not None:
        scale = x.scale.to(dev, torch.float64).reshape(1)
    else:
        scale = torch.ones(1, dtype=torch.float64, device=dev)
    inv = 1.0 if (x.scale is None or x.unscaled_already) else scale.reciprocal()
    pack, update = layers.grad_pack(inv, x.unattributed), x.previous_update  # layer_pack, update_pack?
    loss_t = x.loss if isinstance(x.loss, torch.Tensor) else None
    summary = summary_pack(x.scores, x.top_k) if x.scores is not None else None
    rows, shared = None, {}
    if x.comm is not None:
        top, total = (0.0, 0.0)
        if summary is not None:
            tl = summary_layout(x.scores, x.top_k, len(x.token_layers))
            top, total = tl.get(summary, "top_vals")[:1].sum(), tl.get(summary, "total")[0]  # (none: 0)
        job = job_vector(loss_t if loss_t is not None else x.loss, top, total * x.score_weight, dev)
        got = gather_step(x.comm, layers.n_layers, pack if layers.sharded else None, update, job,
                          {"rl_job": job_rl_row(x.rl, dev), "precursor_rows": x.precursor_row})
        pack = got.layers if got.layers is not None else pack
        update = got.update if got.update is not None else update  # summed: (3L + 1,), ends with a count
        rows, shared = got.jobs, got.shared
    fields = {"layers": pack, "scale": scale, "loss": loss_t, "tokens": summary, "rl": x.rl, "samples": x.samples,
              "check": x.scores.check if x.scores is not None else None, "update": update,
              "job": rows.flatten() if rows is not None else None,  # (W, 3) -> (3W,)
              "groups": x.group_tokens, "precursors": x.precursors[1] if x.precursors is not None else None,
              **{k: v.flatten() for k, v in shared.items()}}  # the shared segments' rows: (W, n) -> (W·n,)
    fields = {k: v.detach().to(dev, torch.float64).reshape(-1) for k, v in fields.items() if v is not None}
    layout = Pack.of(**{k: v.numel() for k, v in fields.items()})
    host = layout.build(**fields).cpu().numpy()  # the step's one host transfer
    return _parse(host, layout, layers, x)


def _parse(host: np.ndarray, layout: Pack, layers: LayerStatsCollector, x: StepInputs) -> Assembled:
    L = layers.n_layers
    present = {name for name, _ in layout.fields}
    pack, scale = layout.get(host, "layers"), layout.scalar(host, "scale")
    uncovered_sq = float(layer_pack(L).get(pack, "uncovered_sq")[0])
    loss = layout.scalar(host, "loss") if "loss" in present else float(x.loss) if x.loss is not None else None
    total_sq = float(layer_pack(L).get(pack, "grad_sq").sum())
    finite = math.isfinite(total_sq)
    nonfinite = None if finite else layers.nonfinite_counts()  # rare path: exact counts
    tokens = None
    if "tokens" in present:
        share = uncovered_sq / total_sq if finite and total_sq > 0 else 0.0
        tokens = unpack_summary(layout.get(host, "tokens"), x.scores, x.top_k, x.token_layers, 1.0 / scale**2, share)
    record = StepRecord(
        job=x.job, rank=x.rank, step=x.step, time_unix=time.time(),
        global_norm=math.sqrt(total_sq) if finite else float("nan"), loss=loss,
        micro_batches=x.micro_batches, layers=layers.unpack(pack, nonfinite), tokens=tokens,
        nonfinite=sum(nonfinite) if nonfinite else 0,
        grad_scale=scale if x.scale is not None else None,
        skipped=x.scale is not None and not finite,
        rl=unpack_rl(layout.get(host, "rl")) if "rl" in present else None,
    )
    previous = None
    if "update" in present:
        upd = layout.get(host, "update")
        if x.comm is not None and layers.sharded:  # the job's sums, and how many ranks measured an update
            sums = summed_update_pack(L)
            previous = sums.segment(upd, "delta_sq", "elements").copy() if sums.scalar(upd, "ranks") == x.comm.world_size \
                else None
        else:
            previous = upd.copy()
    job = job_view(layout.get(host, "job").reshape(-1, 3)) if "job" in present else None  # (3W,) -> (W, 3)
    samples = layout.get(host, "samples").copy() if "samples" in present else None
    check = [float(v) for v in layout.get(host, "check")] if "check" in present else None
    groups = layout.get(host, "groups").copy() if "groups" in present else None
    precursors = layout.get(host, "precursors").copy() if "precursors" in present else None
    W = len(layout.get(host, "job")) // 3 if "job" in present else 0  # the job rows: (3W,)
    pre_rows, rl_rows = ((layout.get(host, k).reshape(W, -1) if k in present else None)  # (W·n,) -> (W, n)
                         for k in ("precursor_rows", "rl_job"))
    rl_job = job_rl(rl_rows) if rl_rows is not None else None
    if record.rl is not None:  # the job's policy entropy and KL in the record (one process: its own)
        ent, kl = rl_job if rl_job is not None else (record.rl.entropy_mean, record.rl.kl_rollout)
        record = replace(record, rl=replace(record.rl, job_entropy_mean=ent, job_kl_rollout=kl))
    return Assembled(record, previous, layout.scalar(host, "scale"), job, samples, check, groups, precursors,
                     pre_rows, rl_job)


def with_update_ratios(record: StepRecord, layer_names: Sequence[str], ratios: np.ndarray) -> StepRecord:
    """The record with each layer's ‖Δθ‖/‖θ‖ filled in where known (``ratios`` is NaN elsewhere)."""
    index = {name: i for i, name in enumerate(layer_names)}
    new = []
    for s in record.layers:
        r = ratios[index[s.layer]]
        new.append(replace(s, update_ratio=float(r)) if math.isfinite(r) else s)
    return replace(record, layers=tuple(new))
