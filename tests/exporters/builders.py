"""Small builders of agent-side records for the exporter tests (StepSummary, CorrelatedIncident).

Minimal on purpose: the exporters read only the fields set here. ``tests/store/fixtures.py`` has
richer incidents (spans, localizations) for the store and codec tests.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from gradloc.records import (
    RL_ADVANTAGE_BUCKETS,
    RL_LOG_RATIO_BUCKETS,
    Classification,
    Incident,
    Localization,
    Remedy,
    RLStats,
    SampleOutlier,
    SampleStats,
    SpikeEvent,
    TokenStats,
)
from gradloc.reports import CorrelatedIncident, LayerColumns, StepSummary


def rl_stats(tokens: int = 100) -> RLStats:
    """A step's RL distributions: every token in the bucket just above 0 (log ratio) / 1 (advantage)."""
    lr = [0] * (len(RL_LOG_RATIO_BUCKETS) + 1)
    lr[RL_LOG_RATIO_BUCKETS.index(0.01)] = tokens
    adv = [0] * (len(RL_ADVANTAGE_BUCKETS) + 1)
    adv[RL_ADVANTAGE_BUCKETS.index(1.0)] = tokens
    return RLStats(tokens, tuple(lr), 0.005 * tokens, 0.3, 0.0, 0.9, 0.05, tuple(adv), 0.8 * tokens, 0.8, 2.5, 1.7)


TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


def layer_names(n: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.mlp.down_proj" for i in range(n))


def columns(norms: Sequence[float], names: Sequence[str] | None = None,
            update_ratio: Sequence[float] | None = None) -> LayerColumns:
    """Layer columns with the given gradient norms (max_abs = norm / 10, ratios 1e-3 unless given)."""
    norms = np.asarray(norms, dtype=np.float64)
    n = len(norms)
    ratios = np.full(n, 1e-3) if update_ratio is None else update_ratio
    return LayerColumns.build(tuple(names) if names is not None else layer_names(n), norms, norms / 10,
                              np.zeros(n, dtype=np.int64), np.full(n, 10.0), np.full(n, 1000), ratios)


def step(job: str, rank: int, n: int, layers: LayerColumns, *, time_unix: float, global_norm: float | None = None,
         loss: float | None = 2.5, grad_scale: float | None = None, tokens: bool = True,
         skipped: bool = False, overhead: float | None = 0.03, shed: tuple[str, ...] = (),
         rl: RLStats | None = None, band: tuple[float, float] | None = (1.2, 2.0),
         samples: SampleStats | None = None) -> StepSummary:
    """One rank's step ``n``; the global norm defaults to the L2 norm of the finite layer norms."""
    if global_norm is None:
        finite = layers.grad_norm[np.isfinite(layers.grad_norm)]
        global_norm = float(np.sqrt(np.sum(finite ** 2)))
    stats = TokenStats(tokens=4096, total_score=20.0, top=(), top_share=0.25, micro_batch_shares=(0.5, 0.5),
                       unattributed_share=0.02) if tokens else None
    nonfinite = int(np.sum(~np.isfinite(layers.grad_norm)))
    return StepSummary(job=job, rank=rank, step=n, time_unix=time_unix, global_norm=global_norm, loss=loss, micro_batches=2,
                       layers=layers, tokens=stats, nonfinite=nonfinite, grad_scale=grad_scale, skipped=skipped,
                       overhead_s=None if overhead is None else 0.01, step_s=None if overhead is None else 0.34,
                       overhead=overhead, shed=shed, rl=rl, norm_mean=band and band[0], norm_threshold=band and band[1],
                       samples=samples)


def sample_stats(job: str, rank: int, n: int, time_unix: float) -> SampleStats:
    """A step's per-sample judgement: 16 samples (one a surprise outlier) and an rl_mismatch finding."""
    where = dict(job=job, rank=rank, step=n, time_unix=time_unix)
    surprise = SampleOutlier(kind="surprise", **where, score=8.8, z=12.5, baseline=3.4, micro_batch=1, sample=2,
                             sample_id="uid-9", start=0, end=128, tokens=128, text="qzx vvk", detail="garbage")
    mismatch = SampleOutlier(kind="rl_mismatch", **where, score=0.35, z=30.0, baseline=0.0, tokens=2048)
    return SampleStats(judged=15, unjudged=1, z_counts=(6, 5, 3, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0), z_sum=9.0,
                       max_z=12.5, baseline=3.4, flagged=1, outliers=(surprise, mismatch), rl_mismatch_baseline=0.01)


def incident(job: str, step_n: int, *, trace_id: str = TRACE_ID, global_norm: float = 42.0,
             ranks: Sequence[int] = (0, 1, 2), missing: Sequence[int] = (),
             kinds: tuple[str, ...] = ("grad_spike",), time_unix: float = 1_760_000_000.0,
             probes: int = 3, explained: float | None = 0.9, status: str | None = "located",
             remedy: Remedy | None = None, kind: str | None = "train_inference_mismatch") -> CorrelatedIncident:
    """A correlated incident whose every reporting rank has one finding of ``kinds`` (localized with
    ``status`` unless None; ``remedy`` on every finding)."""
    loc = None if status is None else Localization(step=step_n, method="attribution", status=status,
                                                   probes=probes, explained_share=explained,
                                                   global_norm=global_norm)
    findings = tuple(
        Incident(incident_id=f"{r:02d}{trace_id[2:]}", job=job, rank=r, step=step_n, time_unix=time_unix,
                 spike=SpikeEvent(step=step_n, kinds=kinds, global_norm=global_norm, z=30.0, mean=1.0, std=0.1),
                 localization=loc, remedy=remedy,
                 classification=None if kind is None else Classification(kind, "test"))
        for r in ranks)
    status = "partial" if missing else "complete"
    return CorrelatedIncident(
        incident_id=trace_id[::-1], trace_id=trace_id, job=job, step=step_n, time_unix=time_unix, status=status,
        kinds=kinds, global_norm=global_norm, ranks_expected=tuple(sorted((*ranks, *missing))),
        ranks_reported=tuple(ranks), ranks_missing=tuple(missing), rank_shares=(), micro_batch_shares=(),
        spans=(), findings=findings, closed_unix=time_unix + 1.0, explained_share=explained, probes=probes)


NAN = math.nan
