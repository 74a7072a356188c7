"""Assemble one optimizer step's measurements into a :class:`StepRecord` with one host transfer.

Packed layout (float64): ``[layer pack (4L) | uncovered_sq | scale | loss? | token summary? |
RL pack? | per-sample surprise pack? | token group check (4)? | previous step's update sums (3L)? |
every rank's job vector (3W)?]``. In a multi-rank job
one collective precedes the transfer (collector/job.py); on one rank there is none.
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
from gradloc.collector.rl_fields import PACK_LENGTH as RL_PACK_LENGTH
from gradloc.collector.rl_fields import unpack_rl
from gradloc.collector.token_summary import StepScores, summary_length, summary_pack, unpack_summary
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


@dataclass(frozen=True)
class Assembled:
    record: StepRecord
    previous_update: np.ndarray | None  # (3L,) host copy of StepInputs.previous_update (the job's, when sharded)
    scale: float  # host GradScaler scale (1.0 without a scaler)
    job: JobView | None = None  # a multi-rank job's step, identical on every rank
    samples: np.ndarray | None = None  # host copy of StepInputs.samples
    check: list[float] | None = None  # host copy of the token group's check (parallel/tokens.py)


def assemble(layers: LayerStatsCollector, x: StepInputs) -> Assembled:
    dev = layers.device
    if x.scale is not None:
        scale = x.scale.to(dev, torch.float64).reshape(1)
    else:
        scale = torch.ones(1, dtype=torch.float64, device=dev)
    inv = 1.0 if (x.scale is None or x.unscaled_already) else scale.reciprocal()
    pack, update = layers.grad_pack(inv, x.unattributed), x.previous_update  # (4L + 1,), (3L,)?
    loss_t = x.loss if isinstance(x.loss, torch.Tensor) else None
    summary = summary_pack(x.scores, x.top_k) if x.scores is not None else None
    rows = None
    if x.comm is not None:
        top, total = (summary[len(x.scores.metas)], summary[-1]) if summary is not None else (0.0, 0.0)
        job = job_vector(loss_t if loss_t is not None else x.loss, top, total * x.score_weight, dev)
        shared_pack, shared_update, rows = gather_step(x.comm, layers.n_layers, pack if layers.sharded else None,
                                                       update, job)
        pack = shared_pack if shared_pack is not None else pack
        update = shared_update if shared_update is not None else update  # summed: (3L + 1,), ends with a count
    parts = [pack, scale]  # (4L + 1,), (1,)
    if loss_t is not None:
        parts.append(loss_t.detach().reshape(1))
    if summary is not None:
        parts.append(summary)
    if x.rl is not None:
        parts.append(x.rl)
    if x.samples is not None:
        parts.append(x.samples)
    if x.scores is not None and x.scores.check is not None:
        parts.append(x.scores.check)  # (4,)
    if update is not None:
        parts.append(update)
    if rows is not None:
        parts.append(rows.flatten())  # (W, 3) -> (3W,)
    host = torch.cat([p.to(dev, torch.float64).flatten() for p in parts]).cpu().numpy()  # one transfer
    return _parse(host, layers, x, loss_t is not None)


def _parse(host: np.ndarray, layers: LayerStatsCollector, x: StepInputs, has_loss_t: bool) -> Assembled:
    L = layers.n_layers
    pack = host[: 4 * L]
    uncovered_sq, scale = float(host[4 * L]), float(host[4 * L + 1])
    pos = 4 * L + 2
    if has_loss_t:
        loss: float | None = float(host[pos])
        pos += 1
    else:
        loss = float(x.loss) if x.loss is not None else None
    total_sq = float(pack[:L].sum())
    finite = math.isfinite(total_sq)
    nonfinite = None if finite else layers.nonfinite_counts()  # rare path: exact counts
    tokens = None
    if x.scores is not None:
        n = summary_length(x.scores, x.top_k, len(x.token_layers))
        share = uncovered_sq / total_sq if finite and total_sq > 0 else 0.0
        tokens = unpack_summary(host[pos:pos + n], x.scores, x.top_k, x.token_layers, 1.0 / scale**2, share)
        pos += n
    rl = None
    if x.rl is not None:
        rl = unpack_rl(host[pos:pos + RL_PACK_LENGTH])
        pos += RL_PACK_LENGTH
    samples = None
    if x.samples is not None:
        samples = host[pos:pos + x.samples.numel()].copy()
        pos += x.samples.numel()
    check = None
    if x.scores is not None and x.scores.check is not None:
        check = [float(v) for v in host[pos:pos + 4]]
        pos += 4
    record = StepRecord(
        job=x.job, rank=x.rank, step=x.step, time_unix=time.time(),
        global_norm=math.sqrt(total_sq) if finite else float("nan"), loss=loss,
        micro_batches=x.micro_batches, layers=layers.unpack(pack, nonfinite), tokens=tokens,
        nonfinite=sum(nonfinite) if nonfinite else 0,
        grad_scale=scale if x.scale is not None else None,
        skipped=x.scale is not None and not finite, rl=rl,
    )
    previous = None
    if x.comm is not None and layers.sharded:  # the job's sums, and how many ranks measured an update
        if host[pos + 3 * L] == x.comm.world_size:
            previous = host[pos:pos + 3 * L].copy()
        pos += 3 * L + 1
    elif x.previous_update is not None:
        previous = host[pos:pos + 3 * L].copy()
        pos += 3 * L
    job = job_view(host[pos:].reshape(-1, 3)) if x.comm is not None else None  # (3W,) -> (W, 3)
    return Assembled(record, previous, scale, job, samples, check)


def with_update_ratios(record: StepRecord, layer_names: Sequence[str], ratios: np.ndarray) -> StepRecord:
    """The record with each layer's ‖Δθ‖/‖θ‖ filled in where known (``ratios`` is NaN elsewhere)."""
    index = {name: i for i, name in enumerate(layer_names)}
    new = []
    for s in record.layers:
        r = ratios[index[s.layer]]
        new.append(replace(s, update_ratio=float(r)) if math.isfinite(r) else s)
    return replace(record, layers=tuple(new))
