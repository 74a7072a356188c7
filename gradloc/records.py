"""Frozen records that the stages hand each other (hook → collector → detector → localizer → sinks).

Nothing in here holds a tensor: every field is a plain Python value, so a record can be logged,
compared, pickled or serialised (``to_dict``) without touching the training process's devices.
The JSON form of an :class:`Incident` is documented in ``docs/incident-json.md``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

INCIDENT_SCHEMA_VERSION = 1
SHED_FEATURES = ("update_ratio", "layer_breakdown")  # StepRecord.shed values, in shedding order


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

    @property
    def is_spike(self) -> bool:
        return bool(self.kinds)


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


@dataclass(frozen=True)
class Localization:
    """Where a spike came from, and how sure we are.

    ``explained_share`` = ⟨∇_C, ∇⟩ / ‖∇‖² for the culprit set C, measured with probes (additive over
    a partition of the tokens); ``norm_without_culprits`` = ‖∇ − ∇_C‖, the norm the step would have
    had without them; ``loss_share`` = the culprits' part of the step's loss. ``verified`` means the
    detector would not have flagged the step without the culprits (or C explains
    ≥ ``min_explained_share`` of ‖∇‖²).
    """

    step: int
    method: str  # "attribution" | "bisection" | "none"
    status: str  # "located" | "diffuse" | "unverified" | "unavailable"
    probes: int
    explained_share: float | None
    global_norm: float
    culprit_norm: float | None
    norm_without_culprits: float | None
    culprits: tuple[Culprit, ...]
    spans: tuple[CulpritSpan, ...]
    micro_batch_shares: tuple[float, ...] = ()
    unattributed_share: float = 0.0
    loss_share: float | None = None
    loss_without_culprits: float | None = None
    note: str = ""
    samples: tuple[SampleShare, ...] = ()  # the samples carrying most of the attribution score


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
