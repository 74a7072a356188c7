"""One optimizer step of a multi-rank job: the one collective that makes every rank see the same step.

Every rank must take the same path at a spike (probes and their collectives run in lockstep), so
the detector on every rank must see identical inputs. Its inputs are the global gradient norm and
per-layer norms — identical on every rank under DDP (the all-reduced gradient), combined from the
shards under FSDP2 — plus the loss and the top token's share, which are per rank. So every step
each rank contributes ``[loss, top token score, total token score]`` to one ``all_gather``; each
rank then judges the *job's* step: the mean loss and the largest top-token score over the sum of
totals. Under FSDP2 the same collective also carries each rank's shard statistics (the layer pack,
and the update-ratio sums), summed (max for max |g|) into the job's. One collective per step, O(L)
floats; nothing else communicates on a healthy step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping, Protocol

import numpy as np
import torch

from gradloc.collector.layer_stats import combine_packs
from gradloc.collector.packs import JOB_ROW, Pack, layer_pack, summed_update_pack, update_pack

if TYPE_CHECKING:
    from gradloc.records import StepRecord


class Gather(Protocol):
    world_size: int

    def all_gather(self, t: torch.Tensor, what: str = ...) -> torch.Tensor: ...


@dataclass(frozen=True)
class JobView:
    """What every rank's detector sees of the job's step (identical on all ranks)."""

    loss: float | None  # mean of the ranks' losses
    top_share: float  # the largest top-token score over the sum of all ranks' totals


def job_vector(loss: torch.Tensor | float | None, top: torch.Tensor | float, total: torch.Tensor | float,
               device: torch.device) -> torch.Tensor:
    """(3,) float64 ``packs.JOB_ROW``: [loss (NaN unknown), top token score, total token score] of this rank."""
    def t(x):  # noqa: ANN001, ANN202
        return x.detach().to(device, torch.float64).reshape(1) if isinstance(x, torch.Tensor) else \
            torch.tensor([math.nan if x is None else float(x)], dtype=torch.float64, device=device)

    return JOB_ROW.build(loss=t(loss), top=t(top), total=t(total))


def step_row(n_layers: int, summed: bool, shared: Mapping[str, int] | None = None) -> Pack:
    """A rank's row of the step gather: its job row and, when the job sums its ranks' packs, its layer pack and
    update sums — always there, zeros where this rank measured none this step, and a 1/0 saying which — then the
    ``shared`` segments every rank sends at the same length (their names and lengths: the RL entropy and KL sums,
    collector/rl_fields.py's JOB_RL; the precursor slots in a layout the ranks agreed on,
    collector/precursors/job.py)."""
    row = JOB_ROW
    if summed:
        row = row + Pack.of(layers=len(layer_pack(n_layers)), update=len(update_pack(n_layers)), has_update=1)
    shared = {k: n for k, n in (shared or {}).items() if n}
    return row + Pack.of(**shared) if shared else row


@dataclass(frozen=True)
class Gathered:
    """The step gather's results: the job's layer pack and update sums (when the job sums its ranks'), the (W, 3)
    job rows and each shared segment's (W, n) rows, by name."""

    layers: torch.Tensor | None
    update: torch.Tensor | None
    jobs: torch.Tensor
    shared: dict[str, torch.Tensor]


def gather_step(comm: Gather, n_layers: int, layers: torch.Tensor | None, update: torch.Tensor | None,
                job: torch.Tensor, shared: Mapping[str, torch.Tensor] | None = None) -> Gathered:
    """All-gather this rank's :func:`step_row` in one collective.

    The row's layout is the same on every rank whatever each rank's optional state (its meter may have shed the
    update ratios; a shared segment's length is the same on every rank); the returned (3L + 1,) update sums end with
    the number of ranks that had one (collector/step.py uses them only when that is every rank)."""
    shared = {k: v for k, v in (shared or {}).items() if v is not None and len(v)}
    row = step_row(n_layers, layers is not None, {k: len(v) for k, v in shared.items()})
    f64 = dict(dtype=torch.float64, device=job.device)
    parts = {"loss": JOB_ROW.get(job, "loss"), "top": JOB_ROW.get(job, "top"), "total": JOB_ROW.get(job, "total")}
    if layers is not None:
        parts.update(layers=layers.to(**f64), has_update=torch.tensor([float(update is not None)], **f64),
                     update=update.to(**f64) if update is not None else torch.zeros(len(update_pack(n_layers)), **f64))
    parts.update({k: v.to(**f64) for k, v in shared.items()})
    rows = comm.all_gather(row.build(**parts), "gradloc step gather")  # (W, len(row))
    out_pack = out_update = None
    if layers is not None:
        out_pack = combine_packs(row.get(rows, "layers"), n_layers)  # (W, 4L + 1) -> (4L + 1,)
        summed = row.get(rows, "update").sum(0)  # (W, 3L) -> (3L,)
        out_update = summed_update_pack(n_layers).build(**update_pack(n_layers).split(summed),
                                                        ranks=row.get(rows, "has_update").sum(0))  # (3L + 1,)
    return Gathered(out_pack, out_update, rows[:, :len(JOB_ROW)],  # (W, 3): the JOB_ROW fields lead the row
                    {k: row.get(rows, k) for k in shared})  # each (W, n)


def job_view(rows: np.ndarray) -> JobView:
    """The job's loss and top-token share from the (W, 3) host rows."""
    losses = rows[:, 0][np.isfinite(rows[:, 0])]
    total = float(np.nansum(rows[:, 2]))
    top = float(np.nanmax(rows[:, 1])) if np.isfinite(rows[:, 1]).any() else 0.0
    return JobView(float(losses.mean()) if losses.size else None, top / total if total > 0 else 0.0)


def as_judged(record: "StepRecord", job: JobView | None) -> "StepRecord":
    """What the detector sees: in a multi-rank job the job's loss and top-token share, so that every
    rank's detector gets the same inputs and every rank takes the same path at a spike. Each rank's
    samples stay its own: the detector asks the job whether any rank holds an outlier
    (``SpikeDetector.agree``) on a step above its sample band."""
    if job is None:
        return record
    tokens = replace(record.tokens, top_share=job.top_share) if record.tokens is not None else None
    return replace(record, loss=job.loss, tokens=tokens)
