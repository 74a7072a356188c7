"""Per-step records: what the hooks and the collector measure on every step, and the detector's verdict."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gradloc.records.findings import SampleStats
from gradloc.records.groups import GroupTokens
from gradloc.records.precursors import PrecursorFinding, PrecursorStat

INCIDENT_SCHEMA_VERSION = 1
SHED_FEATURES = ("update_ratio", "layer_breakdown")  # StepRecord.shed values, in shedding order
# Bucket bounds of RLStats' histograms (a value v falls in the first bucket whose bound is >= v; the
# last count is above the last bound). Log ratios are symmetric around 0, advantages in their own units.
RL_LOG_RATIO_BUCKETS = (-4.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.02, -0.01, 0.0,
                        0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
RL_ADVANTAGE_BUCKETS = (-10.0, -5.0, -3.0, -2.0, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0)


def to_dict(record: Any) -> dict[str, Any]:
    """Plain-JSON form of any record (tuples become lists, non-finite floats become strings)."""
    return _jsonable(dataclasses.asdict(record))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


@dataclass(frozen=True, kw_only=True)
class LayerStats:
    """Gradient statistics of one layer group at the optimizer boundary (unscaled gradients)."""

    layer: str
    grad_norm: float
    grad_max_abs: float
    nonfinite: int
    param_norm: float
    numel: int
    update_ratio: float | None = None  # ‖θ_after − θ_before‖ / ‖θ_before‖, once the step ran
    # the detector's z-score of this layer's norm at the step, set on Incident.top_layers only (None: unknown:
    # the detector's warm-up, a non-finite norm, a client before this field)
    z: float | None = None


@dataclass(frozen=True)
class LayerShare:
    """One layer's share of a token's attribution score."""

    layer: str
    share: float


@dataclass(frozen=True, kw_only=True)
class TokenScore:
    """Attribution score of one (micro-batch, sample, position)."""

    micro_batch: int
    sample: int
    position: int
    score: float  # Σ over attributed layers of ‖contribution through this position‖²
    share: float  # score / total attributed score of the step
    token_id: int | None = None
    sample_id: str | None = None
    layers: tuple[LayerShare, ...] = ()


@dataclass(frozen=True, kw_only=True)
class TokenStats:
    """Per-token summary of one optimizer step (all micro-batches)."""

    tokens: int
    total_score: float
    top: tuple[TokenScore, ...]
    top_share: float
    micro_batch_shares: tuple[float, ...]
    unattributed_share: float  # share of ‖∇‖² in parameters no per-token rule covered
    dropped_calls: int = 0  # module calls whose shapes did not match the micro-batch


@dataclass(frozen=True)
class RLStats:
    """Distributions of one step's per-token RL fields over its loss tokens (trainer side, summed
    over micro-batches). Histogram counts are per bucket of ``gradloc.exporters.metric_specs``'
    ``RL_LOG_RATIO_BUCKETS`` / ``RL_ADVANTAGE_BUCKETS`` (the last count is above the last bound).
    Fields the trainer did not give are None (or empty counts)."""

    tokens: int  # loss tokens with RL fields
    # training–inference mismatch: log π_old − log π_rollout (log π_train − log π_rollout without an old policy)
    log_ratio_counts: tuple[int, ...] = ()
    log_ratio_sum: float | None = None
    max_abs_log_ratio: float | None = None
    mismatch_fraction: float | None = None  # tokens whose |mismatch log ratio| is above the threshold
    max_abs_log_ratio_old: float | None = None  # log π_train − log π_old (staleness)
    clip_fraction: float | None = None  # tokens whose importance ratio the loss clipped
    advantage_counts: tuple[int, ...] = ()
    advantage_sum: float | None = None
    advantage_rms: float | None = None
    max_abs_advantage: float | None = None
    entropy_mean: float | None = None
    # KL(π_rollout ‖ π_trainer) per loss token: the mean over the sampled tokens of exp(r) − 1 − r with r the
    # mismatch log ratio (log π_old, else log π_train, minus log π_rollout): unbiased for tokens drawn from the
    # rollout policy and never negative (Schulman's k3). None without rollout log-probs.
    kl_rollout: float | None = None
    # the job's: over every rank's loss tokens (collector/rl_fields.job_rl), what the drift detector judges; on one
    # process, or a rank whose job values are not known, this rank's own (``entropy_mean``, ``kl_rollout``)
    job_entropy_mean: float | None = None
    job_kl_rollout: float | None = None


@dataclass(frozen=True, kw_only=True)
class StepFields:
    """What one optimizer step of one rank is, whichever side holds it: the trainer's :class:`StepRecord` (per-layer
    statistics as records) and the agent's ``reports.StepSummary`` (the same fields, per-layer statistics as
    columns) both derive from it, so the field list exists once."""

    job: str
    rank: int
    step: int
    time_unix: float
    global_norm: float
    loss: float | None
    micro_batches: int
    tokens: TokenStats | None = None
    nonfinite: int = 0
    grad_scale: float | None = None  # GradScaler scale the raw gradients carried
    skipped: bool = False  # the optimizer step will be skipped (GradScaler found inf/NaN)
    # gradloc's own cost: this step's seconds (hooks, end_step, optimizer hooks; probes excluded),
    # the step's wall seconds (end_step to end_step), and the smoothed ratio gradloc / training
    # (0.04 = 4% added). None while unknown (the first step has no previous end_step).
    overhead_s: float | None = None
    step_s: float | None = None
    overhead: float | None = None
    shed: tuple[str, ...] = ()  # optional work shed to stay within WatchConfig.max_overhead
    rl: RLStats | None = None  # per-token RL fields' distributions (Monitor.rl_fields), when given
    layers_global: bool = False  # the per-layer statistics are the job's (DDP, FSDP2, ZeRO): the same on every rank
    # the detector's healthy band this step was judged against (None during its warm-up): the EMA
    # mean of the global norm, and the grad_spike line a norm must cross (the larger of
    # mean + z_threshold * std and spike_ratio * mean, DetectorConfig)
    norm_mean: float | None = None
    norm_threshold: float | None = None
    samples: "SampleStats | None" = None  # per-sample outlier judgement (SampleConfig), when it ran
    # the monitor's cumulative event counts (Monitor.counters: what it dropped or degraded without raising),
    # non-zero ones, sorted by name; gradloc.records.events declares the names and their meanings
    events: tuple[tuple[str, int], ...] = ()
    # the step's data per group (source, tag, length bucket): samples and loss tokens (records/groups.py); empty
    # when no micro-batch gave provenance (SampleInfo.source / tags)
    groups: tuple[GroupTokens, ...] = ()
    # the step's precursor statistics (records/precursors.py): attention logits and entropy, output logits, the
    # residual stream, MoE routers; empty when PrecursorConfig turns them off or nothing was found to measure
    precursors: tuple[PrecursorStat, ...] = ()
    # the drift detector's findings of the step (detector/drift.py): a precursor moving steadily toward its danger
    precursor_findings: tuple[PrecursorFinding, ...] = ()


@dataclass(frozen=True, kw_only=True)
class StepRecord(StepFields):
    """One optimizer step of one rank, as the trainer side builds it (collector/step.py)."""

    layers: tuple[LayerStats, ...]


class SpikeKind(StrEnum):
    """``SpikeEvent.kinds``: what the detector found (criteria in gradloc/detector/detector.py)."""

    GRAD_SPIKE = "grad_spike"  # global-norm z above the band and norm >= spike_ratio × its mean
    SAMPLE_SPIKE = "sample_spike"  # out of the band, >= sample_ratio × its mean, with a surprise outlier sample
    ABS_THRESHOLD = "abs_threshold"  # global norm above DetectorConfig.abs_threshold
    LAYER_SPIKE = "layer_spike"  # some layer's own z above layer_z_threshold (reported, no incident alone)
    NONFINITE_GRAD = "nonfinite_grad"
    NONFINITE_LOSS = "nonfinite_loss"
    LOSS_SPIKE = "loss_spike"  # z of log(loss) above loss_z_threshold
    TOKEN_SPIKE = "token_spike"  # one token suddenly carries a large share of the gradient
    DIVERGENCE = "divergence"  # the fast EMA of the norm stayed above the slow one
    WARMUP_SPIKE = "warmup_spike"  # in the detector's warm-up, norm > warmup_ratio × its median so far (no incident)
    SKIPPED_STEP = "skipped_step"  # GradScaler found inf/NaN and skips the update (no incident alone)


@dataclass(frozen=True, kw_only=True)
class SpikeEvent:
    """The detector's verdict on one step; ``kinds`` is empty for a healthy step.

    ``mean``/``std``/``loss_mean`` are the healthy statistics the step was judged against (before
    the step itself updated them).
    """

    step: int
    kinds: tuple[SpikeKind, ...]
    global_norm: float
    z: float | None
    mean: float | None
    std: float | None
    loss: float | None = None
    loss_z: float | None = None
    loss_mean: float | None = None
    layers: tuple[str, ...] = ()  # layers whose own z-score crossed the layer threshold
    detail: str = ""
    # the step of the incident whose episode this step belongs to (the run reacting to that spike):
    # its kinds open no new incident. None on the step that opens an incident and outside episodes.
    episode: int | None = None
    # on a step that opens an incident inside an earlier incident's episode because its culprits are new data
    # (gradloc/detector/detector.py, "new cause"): that incident's step. None otherwise.
    follows: int | None = None
    # on a step that opens an incident: the last step before its episode that the detector found healthy (no kind
    # at all, outside any episode) — the checkpoint to roll back to is one saved at or before it. None otherwise,
    # and when no step before was healthy.
    last_healthy_step: int | None = None

    def __post_init__(self) -> None:  # plain strings from a decoder or a test become the typed values
        if not all(type(k) is SpikeKind for k in self.kinds):
            object.__setattr__(self, "kinds", tuple(SpikeKind(k) for k in self.kinds))

    @property
    def is_spike(self) -> bool:
        return bool(self.kinds)
