"""Per-sample findings: samples whose surprise stands out (not incidents: no probe, no page)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gradloc.records.provenance import SampleInfo

# -- per-sample findings (gradloc/collector/surprise.py, gradloc/detector/samples.py) -----------------
# Buckets of the per-sample surprise z-score distribution (``SampleStats.z_counts``; the last count is
# above the last bound; z <= 0 falls in the first bucket).
SAMPLE_Z_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0, 50.0)


class OutlierKind(StrEnum):
    """``SampleOutlier.kind``: what stood out."""

    SURPRISE = "surprise"  # one sample's surprise against the run's history
    RL_MISMATCH = "rl_mismatch"  # a step's training–inference mismatch above the run's baseline, sustained


OUTLIER_KINDS = tuple(k.value for k in OutlierKind)  # ("surprise", "rl_mismatch")


@dataclass(frozen=True, kw_only=True)
class SampleOutlier:
    """A finding, not an incident: no probe ran and nothing pages. One sample whose surprise stands out
    against the run's own history (``kind="surprise"``), or a step whose training–inference mismatch
    stayed above the run's baseline (``kind="rl_mismatch"``: no sample fields).

    ``score``: for ``surprise``, the sample's mean surprise in nats per loss token (−log p of the
    scored token, each token capped at −log 1e-4, p read off the loss head's output gradient), over
    the span ``[start, end)`` of its positions that stood out most (the whole sample, or its worst
    window); for ``rl_mismatch``, the step's share of loss tokens whose |log π_trainer −
    log π_rollout| exceeds log 2. ``baseline``: the run's healthy level it was judged against (the
    median of recent samples' scores, or of healthy steps' shares); ``z``: (score − baseline) / the
    history's robust spread."""

    kind: OutlierKind
    job: str
    rank: int
    step: int
    time_unix: float
    score: float
    z: float
    baseline: float
    micro_batch: int | None = None
    sample: int | None = None
    sample_id: str | None = None
    start: int | None = None
    end: int | None = None  # exclusive
    tokens: int = 0  # loss tokens judged (rl_mismatch: the step's RL loss tokens)
    text: str | None = None  # the span's decoded text (at most SampleConfig.excerpt_tokens tokens)
    detail: str = ""
    sample_info: SampleInfo | None = None  # where the sample came from (its loader's provenance), when given

    def __post_init__(self) -> None:  # a plain string from a decoder or a test becomes the typed value
        if type(self.kind) is not OutlierKind:
            object.__setattr__(self, "kind", OutlierKind(self.kind))


@dataclass(frozen=True, kw_only=True)
class SampleStats:
    """One step's per-sample judgement (``StepRecord.samples``): how many samples were judged, the
    distribution of their z-scores (``SAMPLE_Z_BUCKETS``; empty during the warm-up), the outliers."""

    judged: int = 0
    unjudged: int = 0  # samples with too few loss tokens, of RL micro-batches, or without a usable head gradient
    nonfinite: int = 0  # samples with a non-finite loss gradient at the head (never judged)
    z_counts: tuple[int, ...] = ()
    z_sum: float = 0.0
    max_z: float | None = None
    baseline: float | None = None  # the run's median surprise (nats per token) the step was judged against
    flagged: int = 0  # surprise outliers this step (``outliers`` holds at most SampleConfig.max_outliers of them)
    outliers: tuple[SampleOutlier, ...] = ()
    rl_mismatch_baseline: float | None = None  # the run's healthy mismatch share (None before its warm-up)
    # steps in a row, up to this one, whose mismatch share is above the rl_mismatch line (0: this one is not);
    # the finding comes when it reaches SampleConfig.rl_patience. The detector reads it (a new cause in an episode)
    rl_mismatch_streak: int = 0
