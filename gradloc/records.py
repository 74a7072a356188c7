"""Frozen records that the stages hand each other (hook → collector → detector → localizer → sinks).

Nothing in here holds a tensor: every field is a plain Python value, so a record can be logged,
compared, pickled or serialised (``to_dict``) without touching the training process's devices.
The JSON form of an :class:`Incident` is documented in ``docs/incident-json.md``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

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


@dataclass(frozen=True)
class LayerStats:
    """Gradient statistics of one layer group at the optimizer boundary (unscaled gradients)."""

    layer: str
    grad_norm: float
    grad_max_abs: float
    nonfinite: int
    param_norm: float
    numel: int
    update_ratio: float | None = None  # ‖θ_after − θ_before‖ / ‖θ_before‖, once the step ran


@dataclass(frozen=True)
class LayerShare:
    """One layer's share of a token's attribution score."""

    layer: str
    share: float


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class StepRecord:
    job: str
    rank: int
    step: int
    time_unix: float
    global_norm: float
    loss: float | None
    micro_batches: int
    layers: tuple[LayerStats, ...]
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


@dataclass(frozen=True)
class SpikeEvent:
    """The detector's verdict on one step; ``kinds`` is empty for a healthy step.

    ``mean``/``std``/``loss_mean`` are the healthy statistics the step was judged against (before
    the step itself updated them).
    """

    step: int
    kinds: tuple[str, ...]
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

    @property
    def is_spike(self) -> bool:
        return bool(self.kinds)


@dataclass(frozen=True)
class TokenRL:
    """One token's RL fields as the loss saw them (None where the trainer did not give one)."""

    logp: float | None = None  # log π_train(token): the policy being trained, this forward
    rollout_logp: float | None = None  # log π_rollout(token): the inference engine that sampled it
    old_logp: float | None = None  # log π_old(token): the policy the ratio is taken against
    advantage: float | None = None
    ratio: float | None = None  # the importance ratio the loss used
    clipped: bool | None = None  # whether the loss clipped that ratio
    entropy: float | None = None
    sequence_log_ratio: float | None = None  # mean of the mismatch log ratio over the sequence's loss tokens

    @property
    def log_ratio(self) -> float | None:
        """Training–inference mismatch: the trainer's log-prob of the policy that sampled the token
        (``old_logp`` when given, else ``logp``: on-policy they are the same weights) minus the
        inference engine's, ``rollout_logp``. Both score the same weights, so any gap is the two
        engines disagreeing — not the policy having moved (that is ``log_ratio_old``)."""
        trainer = self.old_logp if self.old_logp is not None else self.logp
        return None if trainer is None or self.rollout_logp is None else trainer - self.rollout_logp

    @property
    def log_ratio_old(self) -> float | None:
        """log π_train − log π_old (staleness)."""
        return None if self.logp is None or self.old_logp is None else self.logp - self.old_logp


@dataclass(frozen=True)
class SampleInfo:
    """Where a sample came from (RL rollouts): the request, the completion, and its spans.

    Spans are in the coordinates gradloc reports positions in: *loss positions*, where position p
    scores token p + 1 of the sequence. The response's tokens are scored at positions
    [response_start, response_start + response_tokens); a culprit's response token index is
    ``position - response_start``.
    """

    request_id: str | None = None
    completion_index: int | None = None
    prompt_tokens: int = 0
    response_start: int = 0
    response_tokens: int = 0
    finish_reason: str | None = None


@dataclass(frozen=True)
class Evidence:
    name: str
    value: float


@dataclass(frozen=True)
class Classification:
    """What kind of spike (or culprit) this is, with the numbers that decided it.

    ``kind``: ``train_inference_mismatch``, ``low_prob_high_advantage``, ``stale_off_policy``,
    ``layer_concentrated``, ``diffuse``, or ``unclassified`` (criteria in docs/rl.md).
    """

    kind: str
    reason: str
    evidence: tuple[Evidence, ...] = ()


@dataclass(frozen=True)
class Culprit:
    """One culprit token with its share of the step's gradient norm²."""

    micro_batch: int
    sample: int
    position: int
    share: float
    score_share: float
    token_id: int | None = None
    text: str | None = None
    sample_id: str | None = None
    layers: tuple[LayerShare, ...] = ()
    rl: TokenRL | None = None
    classification: Classification | None = None
    sample_info: SampleInfo | None = None
    rank: int | None = None  # the rank whose micro-batch holds it (an in-job incident; None: the incident's rank)


MAX_SPAN_WINDOW = 1024  # tokens of CulpritSpan.window_* (the daemon refuses more)


@dataclass(frozen=True)
class CulpritSpan:
    """Adjacent culprit tokens of one sample, with decoded text and surrounding context."""

    micro_batch: int
    sample: int
    start: int
    end: int  # exclusive
    share: float
    token_ids: tuple[int, ...] = ()
    text: str | None = None
    context_before: str | None = None
    context_after: str | None = None
    sample_id: str | None = None
    sample_info: SampleInfo | None = None
    rank: int | None = None
    # The tokens of the sample around and in the span, from position ``window_start``: each one's
    # decoded text and its share of the step's per-token attribution score (what the incident page
    # colours). Empty without token ids or a tokenizer.
    window_start: int = 0
    window_tokens: tuple[str, ...] = ()
    window_scores: tuple[float, ...] = ()


@dataclass(frozen=True)
class SampleShare:
    """Where the norm sits at the sample level: one sample of one micro-batch.

    ``score_share`` is the sample's part of the step's per-token attribution score (free, one
    pass); ``share`` is measured with a probe, ⟨∇_S, ∇⟩ / ‖∇‖² for the sample's loss tokens S, or
    None when no probe was spent on it.
    """

    micro_batch: int
    sample: int
    score_share: float
    share: float | None = None
    sample_id: str | None = None
    tokens: int = 0  # loss tokens in the sample
    rank: int | None = None


class Status(StrEnum):
    """``Localization.status``: how far localization got."""

    LOCATED = "located"  # a verified culprit set (or the positions of a non-finite gradient)
    DIFFUSE = "diffuse"  # no token, span, sample or micro-batch carries the spike; top shares reported
    UNVERIFIED = "unverified"  # candidates without probes (no probe closure): attribution shares only
    UNAVAILABLE = "unavailable"  # no per-token statistics, or localization failed (the note says why)


class Method(StrEnum):
    """``Localization.method``: how the culprits were found."""

    ATTRIBUTION = "attribution"  # one-pass attribution, verified by probes (and the decomposition probe)
    BISECTION = "bisection"  # GradLoc-style probe bisection
    NONE = "none"


class Level(StrEnum):
    """``Localization.level``: the level at which the data went wrong (docs/DESIGN-NOTES.md, "Levels").

    ``token``: single tokens; ``span``: contiguous tokens of one sample; ``sample``: a whole sample
    (its gradient coherent across its tokens, no shorter span carries it); ``micro_batch``: a
    micro-batch and no sample of it alone; ``rank``: every micro-batch of one rank of a job together,
    and no micro-batch or sample of it alone (a rank's data went wrong: a bad shard, a broken loader).
    Empty when nothing was located."""

    TOKEN = "token"
    SPAN = "span"
    SAMPLE = "sample"
    MICRO_BATCH = "micro_batch"
    RANK = "rank"
    NONE = ""


@dataclass(frozen=True, kw_only=True)
class CulpritGroup:
    """The data named at level ``micro_batch`` (one micro-batch) or ``rank`` (every micro-batch of one
    rank: ``micro_batch`` None), with its measured share ⟨∇_G, ∇⟩ / ‖∇‖² and what it holds."""

    share: float
    micro_batch: int | None = None
    rank: int | None = None  # None: the incident's own rank (one process)
    micro_batches: int = 1  # micro-batches in the group
    samples: int = 0
    tokens: int = 0  # loss tokens


@dataclass(frozen=True, kw_only=True)
class Localization:
    """Where a spike came from, and how sure we are.

    ``explained_share`` = ⟨∇_C, ∇⟩ / ‖∇‖² for the culprit set C, measured with probes (additive over
    a partition of the tokens); ``norm_without_culprits`` = ‖∇ − ∇_C‖, the norm the step would have
    had without them; ``loss_share`` = the culprits' part of the step's loss. ``verified`` means the
    detector would not have flagged the step without the culprits (or C explains
    ≥ ``min_explained_share`` of ‖∇‖²).
    """

    step: int
    method: Method
    status: Status
    probes: int
    global_norm: float
    explained_share: float | None = None
    culprit_norm: float | None = None
    norm_without_culprits: float | None = None
    culprits: tuple[Culprit, ...] = ()
    spans: tuple[CulpritSpan, ...] = ()
    level: Level = Level.NONE
    micro_batch_shares: tuple[float, ...] = ()
    unattributed_share: float = 0.0
    loss_share: float | None = None
    loss_without_culprits: float | None = None
    note: str = ""
    samples: tuple[SampleShare, ...] = ()  # the samples carrying most of the attribution score
    # passes beside one per probe: the decomposition probe's two forward-only passes, and a rank
    # probe's micro-batches after its first (one probe measures a rank's every micro-batch together)
    passes: int = 0
    groups: tuple[CulpritGroup, ...] = ()  # the micro-batch or rank named at level micro_batch or rank

    def __post_init__(self) -> None:  # plain strings from a decoder or a test become the typed values
        object.__setattr__(self, "method", Method(self.method))
        object.__setattr__(self, "status", Status(self.status))
        object.__setattr__(self, "level", Level(self.level))


@dataclass(frozen=True)
class Remedy:
    """What the opt-in remedy (``WatchConfig.remedy``) did to a spike step's gradient.

    ``drop_culprits``: the gradient became ∇ − ∇_C (``norm_after`` = ‖∇ − ∇_C‖); ``skip_step``:
    every gradient was set to None, so the optimizer changed nothing (``norm_after`` = 0).
    ``applied`` is False when the step did not qualify (``reason`` says why).
    """

    action: str
    applied: bool
    norm_before: float
    norm_after: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class Incident:
    incident_id: str
    job: str
    rank: int
    step: int
    time_unix: float
    spike: SpikeEvent
    localization: Localization | None
    schema_version: int = INCIDENT_SCHEMA_VERSION
    top_layers: tuple[LayerStats, ...] = field(default=())  # largest layer norms at the spike
    remedy: Remedy | None = None
    classification: Classification | None = None
    # "rank": this rank's own finding; "job": localized across the ranks of a DDP/FSDP2/ZeRO job and
    # emitted once (by rank 0): culprits, spans and samples name their rank, shares are the job's
    scope: str = "rank"


# -- per-sample findings (gradloc/collector/surprise.py, gradloc/detector/samples.py) -----------------
# Buckets of the per-sample surprise z-score distribution (``SampleStats.z_counts``; the last count is
# above the last bound; z <= 0 falls in the first bucket).
SAMPLE_Z_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0, 50.0)
OUTLIER_KINDS = ("surprise", "rl_mismatch")


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

    kind: str
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
