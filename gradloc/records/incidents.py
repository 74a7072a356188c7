"""Incident records: a spike's localization (culprit tokens, spans, samples, groups), remedy and class."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from gradloc.records.provenance import SampleInfo
from gradloc.records.steps import INCIDENT_SCHEMA_VERSION, LayerShare, LayerStats, SpikeEvent
from gradloc.records.summary import incident_summary, localization_summary


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
class Evidence:
    name: str
    value: float


class ClassKind(StrEnum):
    """``Classification.kind``: the class of a spike or of one culprit token (criteria in docs/rl.md)."""

    TRAIN_INFERENCE_MISMATCH = "train_inference_mismatch"
    LOW_PROB_HIGH_ADVANTAGE = "low_prob_high_advantage"
    STALE_OFF_POLICY = "stale_off_policy"
    LAYER_CONCENTRATED = "layer_concentrated"
    DIFFUSE = "diffuse"
    UNCLASSIFIED = "unclassified"


@dataclass(frozen=True)
class Classification:
    """What kind of spike (or culprit) this is, with the numbers that decided it.

    ``kind``: ``train_inference_mismatch``, ``low_prob_high_advantage``, ``stale_off_policy``,
    ``layer_concentrated``, ``diffuse``, or ``unclassified`` (:class:`ClassKind`; criteria in docs/rl.md).
    """

    kind: ClassKind
    reason: str
    evidence: tuple[Evidence, ...] = ()

    def __post_init__(self) -> None:  # a plain string from a decoder or a test becomes the typed value
        if type(self.kind) is not ClassKind:
            object.__setattr__(self, "kind", ClassKind(self.kind))


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

    def summary(self, job_scope: bool = False) -> str:
        """The answer in one line: status, level, what was named there, its share of ‖∇‖², the probes
        (gradloc/records/summary.py)."""
        return localization_summary(self, job_scope)


class IncidentScope(StrEnum):
    """``Incident.scope``: ``rank``, one rank's own finding; ``job``, localized across the ranks of a
    DDP/FSDP2/ZeRO job and emitted once (by rank 0): culprits, spans and samples name their rank, and
    shares are the job's."""

    RANK = "rank"
    JOB = "job"


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


@dataclass(frozen=True, kw_only=True)
class Incident:
    incident_id: str
    job: str
    rank: int
    step: int
    time_unix: float
    spike: SpikeEvent
    localization: Localization | None
    schema_version: int = INCIDENT_SCHEMA_VERSION
    # every layer's statistics at the spike with the detector's z-score, largest norm first (at most
    # engine.spike.MAX_INCIDENT_LAYERS; incidents from clients before the z field: the five largest)
    top_layers: tuple[LayerStats, ...] = field(default=())
    remedy: Remedy | None = None
    classification: Classification | None = None
    scope: IncidentScope = IncidentScope.RANK  # a plain string becomes the typed value

    def __post_init__(self) -> None:
        object.__setattr__(self, "scope", IncidentScope(self.scope))

    def summary(self) -> str:
        """One line: the incident's id (first 12 hex digits), job, step and ``localization.summary()``."""
        return incident_summary(self)
