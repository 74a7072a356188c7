"""The monitor's drift findings: a step's precursor statistics, RL policy entropy and KL, and update-to-weight
ratios handed to the drift detector (detector/drift.py), with the samples behind each extreme resolved from the
step's micro-batches. Kept out of the monitor's own module.

Nothing here raises into training: a failure is logged, counted (``drift_errors``) and the step goes on without
``StepRecord.precursor_findings``.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

from gradloc.collector.batch import MicroBatchMeta
from gradloc.config import DriftConfig
from gradloc.detector.drift import DriftDetector, Observation
from gradloc.records import PrecursorDriver, PrecursorFinding, StepRecord
from gradloc.records.precursors import RL_ENTROPY, RL_KL, UPDATE_RATIO, PrecursorKind

log = logging.getLogger("gradloc")


@dataclass(frozen=True, kw_only=True)
class JobShare:
    """Which of a multi-rank step's series are the job's — the same values on every rank, so every rank finds the
    same, and one rank reports each finding (the others count it: ``precursor_findings_elsewhere``)."""

    rank: int  # this rank's number in the job
    precursors: bool = False  # the precursor values (collector/precursors/job.py): the rank of the top driver reports
    rl: tuple[float | None, float | None] | None = None  # the job's policy entropy and KL (rl_fields.job_rl): rank 0
    ratios: bool = False  # the update ratios are the same on every rank (data parallelism alone): rank 0

    def reports(self, f: PrecursorFinding) -> bool:
        if f.statistic in _PRECURSOR_STATISTICS and self.precursors:
            owner = f.drivers[0].rank if f.drivers and f.drivers[0].rank is not None else 0
        elif (f.statistic in (RL_ENTROPY, RL_KL) and self.rl is not None) or (f.statistic == UPDATE_RATIO
                                                                               and self.ratios):
            owner = 0
        else:
            return True  # this rank's own series
        return owner == self.rank


_PRECURSOR_STATISTICS = frozenset(k.value for k in PrecursorKind)


class DriftWatch:
    def __init__(self, cfg: DriftConfig, counters: Counter[str]) -> None:
        self.cfg, self.counters = cfg, counters
        self.detector = DriftDetector(cfg, on_drop=self._count) if cfg.enabled else None

    def _count(self, name: str) -> None:
        self.counters[name] += 1

    def watch_step(self, record: StepRecord, metas: Sequence[MicroBatchMeta], job: JobShare | None = None) -> StepRecord:
        """The record with ``precursor_findings`` filled in (unchanged when nothing was found or it failed);
        ``job``: what of it is the job's, in a multi-rank job."""
        if self.detector is None:
            return record
        try:
            where = dict(job=record.job, rank=record.rank, time_unix=record.time_unix)
            found = self.detector.observe(record.step, observations(record, metas, job), where)
            if job is not None:
                mine = [f for f in found if job.reports(f)]
                if len(mine) < len(found):
                    self.counters["precursor_findings_elsewhere"] += len(found) - len(mine)
                found = mine
        except Exception:  # noqa: BLE001 - never raise into training
            self.counters["drift_errors"] += 1
            log.warning("gradloc: the drift detector failed this step", exc_info=True)
            return record
        if found:
            self.counters["precursor_findings"] += len(found)
            return replace(record, precursor_findings=tuple(found))
        return record


def observations(record: StepRecord, metas: Sequence[MicroBatchMeta],
                 job: JobShare | None = None) -> Iterator[Observation]:
    """The step's series values: each precursor statistic (with its driver: resolved to a sample where this rank
    holds it), the RL policy entropy and KL to the rollout policy (the job's, when ``job`` has them), and each
    layer's update-to-weight ratio."""
    by_index = {m.index: m for m in metas}
    for p in record.precursors:
        here = p.rank is None or (job is not None and p.rank == job.rank)
        yield Observation(statistic=p.kind.value, layer=p.layer, head=p.head, value=p.value,
                          driver=driver(record.step, p.value, p.at, by_index if here else {}, p.rank))
    if job is not None and job.rl is not None:
        entropy, kl = job.rl
    else:
        entropy, kl = (record.rl.entropy_mean, record.rl.kl_rollout) if record.rl is not None else (None, None)
    if entropy is not None:
        yield Observation(statistic=RL_ENTROPY, layer="", value=entropy)
    if kl is not None:
        yield Observation(statistic=RL_KL, layer="", value=kl)
    for layer in record.layers:
        if layer.update_ratio is not None:
            yield Observation(statistic=UPDATE_RATIO, layer=layer.layer, value=layer.update_ratio)


def driver(step: int, value: float, at: tuple[int, int, int] | None, metas: dict[int, MicroBatchMeta],
           rank: int | None = None) -> PrecursorDriver | None:
    """Where a statistic's extreme was: (micro-batch, row, position) → the sample, its id and provenance (``metas``:
    the step's micro-batches, empty when they are another rank's; ``rank``: whose, in a job's values)."""
    if at is None:
        return None
    mb, row, pos = at
    meta = metas.get(mb)
    if meta is None:
        return PrecursorDriver(step=step, value=value, micro_batch=mb, sample=row, position=pos, rank=rank)
    sample, position = meta.locate(row * meta.seq + pos)  # (B, T) → flat; packed (1, N): row 0
    if sample >= meta.n_samples:
        return PrecursorDriver(step=step, value=value, micro_batch=mb, sample=row, position=pos, rank=rank)
    return PrecursorDriver(step=step, value=value, micro_batch=mb, sample=sample, position=position,
                           sample_id=meta.sample_id(sample), sample_info=meta.sample_info(sample), rank=rank)


__all__ = ["DriftWatch", "JobShare", "observations"]
