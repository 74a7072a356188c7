"""The monitor's drift findings: a step's precursor statistics, RL policy entropy and KL, and update-to-weight
ratios handed to the drift detector (detector/drift.py), with the samples behind each extreme resolved from the
step's micro-batches. Kept out of the monitor's own module.

Nothing here raises into training: a failure is logged, counted (``drift_errors``) and the step goes on without
``StepRecord.precursor_findings``.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from typing import Iterator, Sequence

from gradloc.collector.batch import MicroBatchMeta
from gradloc.config import DriftConfig
from gradloc.detector.drift import DriftDetector, Observation
from gradloc.records import PrecursorDriver, PrecursorFinding, StepRecord
from gradloc.records.precursors import RL_ENTROPY, RL_KL, UPDATE_RATIO, PrecursorKind

log = logging.getLogger("gradloc")


class DriftWatch:
    def __init__(self, cfg: DriftConfig, counters: Counter[str]) -> None:
        self.cfg, self.counters = cfg, counters
        self.detector = DriftDetector(cfg, on_drop=self._count) if cfg.enabled else None

    def _count(self, name: str) -> None:
        self.counters[name] += 1

    def watch_step(self, record: StepRecord, metas: Sequence[MicroBatchMeta], job_rank: int | None = None) -> StepRecord:
        """The record with ``precursor_findings`` filled in (unchanged when nothing was found or it failed).

        ``job_rank``: this rank's number when the record's precursor values are the job's (identical on every rank,
        collector/precursors/job.py): every rank then finds the same, and a finding on them is kept by one rank only
        — the one holding its most extreme driver (its sample id is known there), rank 0 when none has a driver."""
        if self.detector is None:
            return record
        try:
            where = dict(job=record.job, rank=record.rank, time_unix=record.time_unix)
            found = self.detector.observe(record.step, observations(record, metas, job_rank), where)
            if job_rank is not None:
                mine = [f for f in found if f.statistic not in _JOB_STATISTICS or _owner(f) == job_rank]
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


_JOB_STATISTICS = frozenset(k.value for k in PrecursorKind)  # the series a job's precursor values feed


def _owner(f: PrecursorFinding) -> int:
    return f.drivers[0].rank if f.drivers and f.drivers[0].rank is not None else 0


def observations(record: StepRecord, metas: Sequence[MicroBatchMeta],
                 job_rank: int | None = None) -> Iterator[Observation]:
    """The step's series values: each precursor statistic (with its driver: resolved to a sample where this rank
    holds it), the RL policy entropy and KL to the rollout policy, and each layer's update-to-weight ratio."""
    by_index = {m.index: m for m in metas}
    for p in record.precursors:
        here = p.rank is None or p.rank == job_rank
        yield Observation(statistic=p.kind.value, layer=p.layer, head=p.head, value=p.value,
                          driver=driver(record.step, p.value, p.at, by_index if here else {}, p.rank))
    rl = record.rl
    if rl is not None:
        if rl.entropy_mean is not None:
            yield Observation(statistic=RL_ENTROPY, layer="", value=rl.entropy_mean)
        if rl.kl_rollout is not None:
            yield Observation(statistic=RL_KL, layer="", value=rl.kl_rollout)
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


__all__ = ["DriftWatch", "observations"]
