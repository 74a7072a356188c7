"""The monitor's per-sample findings: the device pack of a step (collector/surprise.py) and its
judgement on the host (detector/samples.py), kept out of the monitor's own module.

Nothing here raises into training: a failure is logged, counted (``sample_errors``) and the step
goes on without ``StepRecord.samples``.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from gradloc.collector.batch import MicroBatchMeta
from gradloc.collector.surprise import SurprisePack
from gradloc.collector.token_summary import StepScores
from gradloc.config import SampleConfig
from gradloc.detector.samples import MismatchJudge, SampleJudge
from gradloc.records import SampleStats, StepRecord

log = logging.getLogger("gradloc")


class SampleWatch:
    def __init__(self, cfg: SampleConfig, decode: Callable[[list[int]], str] | None, counters: Counter[str],
                 holds_head: bool = True, judges: bool = True) -> None:
        """In a job (parallel/job.py): ``holds_head``, this rank reads the loss head's u_p (a last pipeline stage's
        ranks, each tp rank its vocabulary shard's part); ``judges``, it judges its data index's samples (one rank
        of them)."""
        self.cfg, self.decode, self.counters = cfg, decode, counters
        self.holds_head, self.judges = cfg.enabled and holds_head, cfg.enabled and judges
        self.surprise = SurprisePack(cfg.window, cfg.token_cap)
        self.judge = SampleJudge(cfg)
        self.mismatch = MismatchJudge(cfg)

    def labels(self, meta: MicroBatchMeta) -> torch.Tensor | None:
        """What the token hooks need to keep the head's u_p (None: nothing is kept)."""
        return meta.token_ids if self.holds_head else None

    def pack(self, scores: StepScores | None, rl: set[int]) -> torch.Tensor | None:
        """The step's device pack (travels in the step's one host transfer), or None."""
        if not self.judges or scores is None:
            return None
        try:
            return self.surprise.pack(scores, rl)
        except Exception:  # noqa: BLE001 - never raise into training
            self.counters["sample_errors"] += 1
            log.warning("gradloc: per-sample surprise failed this step", exc_info=True)
            return None

    def judge_step(self, record: StepRecord, host: np.ndarray | None, metas: Sequence[MicroBatchMeta]) -> StepRecord:
        """The record with ``samples`` filled in (unchanged when nothing was judged or it failed)."""
        if not self.judges:
            return record
        where: dict[str, Any] = dict(job=record.job, rank=record.rank, step=record.step, time_unix=record.time_unix)
        try:
            stats = self.judge.judge(host, metas, where, self.decode) if host is not None else None
            baseline, finding = self.mismatch.observe(record.rl, where)
        except Exception:  # noqa: BLE001 - never raise into training
            self.counters["sample_errors"] += 1
            log.warning("gradloc: judging the step's samples failed", exc_info=True)
            return record
        if stats is None and record.rl is None:
            return record
        stats = stats if stats is not None else SampleStats()
        if finding is not None:
            stats = replace(stats, outliers=(*stats.outliers, finding))
        streak = self.mismatch.streak if record.rl is not None and record.rl.mismatch_fraction is not None else 0
        return replace(record, samples=replace(stats, rl_mismatch_baseline=baseline, rl_mismatch_streak=streak))
