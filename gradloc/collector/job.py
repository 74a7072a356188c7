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
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

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
    """(3,) float64: [loss (NaN unknown), top token score, total token score] of this rank."""
    def t(x):  # noqa: ANN001, ANN202
        return x.detach().to(device, torch.float64).reshape(1) if isinstance(x, torch.Tensor) else \
            torch.tensor([math.nan if x is None else float(x)], dtype=torch.float64, device=device)

    return torch.cat([t(loss), t(top), t(total)])


def gather_step(comm: Gather, n_layers: int, layer_pack: torch.Tensor | None, update: torch.Tensor | None,
                job: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """All-gather this rank's job vector (and, when the job sums its ranks' packs, its layer pack and update
    sums) in one collective. Returns the job's layer pack, the job's update sums and the (W, 3) job rows.

    The vector's layout must be the same on every rank whatever each rank's optional state: with a layer
    pack, the update segment is always there — (3L,) sums, zeros where this rank measured none this step
    (its meter shed the update ratios, say), and a 1/0 — and the returned (3L + 1,) sums end with the number
    of ranks that had one (collector/step.py uses them only when that is every rank)."""
    L = n_layers
    parts = [job]
    if layer_pack is not None:
        upd = update.to(job.device, torch.float64) if update is not None else \
            torch.zeros(3 * L, dtype=torch.float64, device=job.device)
        has = torch.ones(1, dtype=torch.float64, device=job.device) * float(update is not None)
        parts += [layer_pack.to(job.device, torch.float64), upd, has]
    rows = comm.all_gather(torch.cat(parts), "gradloc step gather")  # (W, n)
    out_pack = out_update = None
    pos = 3
    if layer_pack is not None:
        packs = rows[:, pos:pos + 4 * L + 1]  # (W, 4L + 1)
        out_pack = packs.sum(0)
        out_pack[L:2 * L] = packs[:, L:2 * L].amax(0)  # max |g| combines by max
        pos += 4 * L + 1
        out_update = rows[:, pos:pos + 3 * L + 1].sum(0)  # (W, 3L + 1) -> (3L + 1,): [sums | ranks that had one]
    return out_pack, out_update, rows[:, :3]


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
