"""Precursor statistics: the slow instabilities that precede a spike, measured every step (../shared/DESIGN.md §10).

One :class:`PrecursorStat` per (kind, layer[, head or expert]) and step, in ``StepFields.precursors``. The
collector (gradloc/collector/precursors/) measures them in the forward pass at no extra pass over the model:

- ``attn_max_logit``: the largest attention logit (q·k × scale, masked positions excluded) of a layer, max over
  heads; ``attn_entropy``: its attention rows' mean entropy (nats), min over heads — for an attention that
  materialises its weights, over every row; for scaled-dot-product attention (SDPA, flash) over
  ``PrecursorConfig.attention_queries`` query rows per sequence, evenly spaced (its T×T is never built);
- ``logit_max_abs``: the loss head's largest |output logit|; ``logit_lse_sq``: its mean logsumexp² (the z-loss
  term, Wortsman et al.) — both over ``PrecursorConfig.head_positions`` positions per micro-batch, evenly spaced;
- ``residual_rms``: the root mean square of the residual stream at the final norm's input (mean over positions);
- ``router_entropy``: a MoE router's mean routing entropy (nats); ``expert_load_max``: its most loaded expert's
  share of the routed tokens over the mean share (1 = balanced); ``dead_experts``: experts no token reached.

RL policy entropy and the KL to the rollout policy are ``RLStats.entropy_mean`` / ``RLStats.kl_rollout``; the
update-to-weight ratios are ``LayerStats.update_ratio``: measured once, where they already are.

``at`` names where a max (or min) was reached: (micro-batch, row, position) — the tokens and samples that drive it.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gradloc.records.provenance import SampleInfo

MAX_PRECURSORS = 4096  # stats of one step on the wire (layers × kinds, heads only where configured)
MAX_PRECURSOR_LAYER = 256  # characters of a layer name


class PrecursorKind(StrEnum):
    ATTN_MAX_LOGIT = "attn_max_logit"
    ATTN_ENTROPY = "attn_entropy"
    LOGIT_MAX_ABS = "logit_max_abs"
    LOGIT_LSE_SQ = "logit_lse_sq"
    RESIDUAL_RMS = "residual_rms"
    ROUTER_ENTROPY = "router_entropy"
    EXPERT_LOAD_MAX = "expert_load_max"
    DEAD_EXPERTS = "dead_experts"


# what a kind's value is (the metric docs and the page say it), and whether falling (not rising) is the danger
PRECURSOR_MEANINGS = {
    PrecursorKind.ATTN_MAX_LOGIT: "largest attention logit of the layer, max over heads (sampled queries on SDPA)",
    PrecursorKind.ATTN_ENTROPY: "mean attention-row entropy of the layer in nats, min over heads",
    PrecursorKind.LOGIT_MAX_ABS: "largest |output logit| at the loss head (head_positions sampled positions)",
    PrecursorKind.LOGIT_LSE_SQ: "mean logsumexp² of the output logits (the z-loss term)",
    PrecursorKind.RESIDUAL_RMS: "root mean square of the residual stream at the final norm's input",
    PrecursorKind.ROUTER_ENTROPY: "mean routing entropy of a MoE router in nats",
    PrecursorKind.EXPERT_LOAD_MAX: "most loaded expert's token share over the mean share (1 = balanced)",
    PrecursorKind.DEAD_EXPERTS: "experts that no token was routed to in the step",
}
FALLING = frozenset({PrecursorKind.ATTN_ENTROPY, PrecursorKind.ROUTER_ENTROPY})  # collapse is a fall


@dataclass(frozen=True, kw_only=True)
class PrecursorStat:
    kind: PrecursorKind
    layer: str  # the module that measured it ("" for none)
    value: float
    head: int | None = None  # an attention head or an expert, where configured (PrecursorConfig.per_head)
    at: tuple[int, int, int] | None = None  # (micro-batch, row, position) of the max / min
    rank: int | None = None  # a job-wide value (collector/precursors/job.py): the rank whose micro-batch ``at`` is in

    def __post_init__(self) -> None:
        problem = precursor_problem(self.kind, self.layer, self.head, self.at, self.rank)
        if problem:
            raise ValueError(f"precursor stat: {problem}")
        object.__setattr__(self, "kind", PrecursorKind(self.kind))


def precursor_problem(kind: object, layer: object, head: object, at: object, rank: object = None) -> str:
    """Why these fields are not a valid stat ('' when they are): a decoder's and the constructor's check."""
    if kind not in tuple(PrecursorKind):
        return f"kind must be one of {[k.value for k in PrecursorKind]}, got {kind!r}"
    if not isinstance(layer, str) or len(layer) > MAX_PRECURSOR_LAYER:
        return f"layer must be a string of at most {MAX_PRECURSOR_LAYER} characters"
    if head is not None and (not isinstance(head, int) or head < 0):
        return f"head must be None or an int >= 0, got {head!r}"
    if at is not None and (len(at) != 3 or any(not isinstance(v, int) or v < 0 for v in at)):
        return f"at must be None or three ints >= 0, got {at!r}"
    if rank is not None and (not isinstance(rank, int) or rank < 0):
        return f"rank must be None or an int >= 0, got {rank!r}"
    return ""


# -- findings of the drift detector (detector/drift.py) -------------------------------------------------------
# the series a finding can name: the precursor kinds, plus what other stages already measure — RL policy entropy
# (RLStats.entropy_mean), the KL to the rollout policy (RLStats.kl_rollout) and each layer's update-to-weight ratio
RL_ENTROPY, RL_KL, UPDATE_RATIO = "rl_entropy", "rl_kl_rollout", "update_ratio"
STATISTICS = (*(k.value for k in PrecursorKind), RL_ENTROPY, RL_KL, UPDATE_RATIO)  # = config/precursors.py's
FALLING_STATISTICS = frozenset({*(k.value for k in FALLING), RL_ENTROPY})
MAX_DRIVERS = 8  # drivers one finding names


class Trend(StrEnum):
    RISING = "rising"  # moving steadily up, away from its own history
    FALLING = "falling"  # moving steadily down
    OSCILLATING = "oscillating"  # swinging without a trend, far wider than its own history


@dataclass(frozen=True, kw_only=True)
class PrecursorDriver:
    """Where the statistic reached one of its most extreme values in the finding's window: the step, the
    micro-batch, the sample (its index in the micro-batch, id and provenance where the loader gave them) and the
    position in the sample. For a router: a token routed to the overloaded expert; for attention: the query row
    with the largest logit or lowest entropy; for the head: the position with the largest |logit|. ``rank``: the
    rank whose micro-batch it is, for a job-wide value (DDP, FSDP2, ZeRO); its sample id and provenance are known
    only to that rank, so a driver on another rank than the finding's names rank, micro-batch, row and position."""

    step: int
    value: float
    micro_batch: int
    sample: int
    position: int
    sample_id: str | None = None
    sample_info: SampleInfo | None = None
    rank: int | None = None


@dataclass(frozen=True, kw_only=True)
class PrecursorFinding:
    """A statistic moving steadily away from its own history (``trend`` rising / falling toward its danger), or
    swinging far wider than it used to (``oscillating``). A finding, not an incident: no probe runs; it pages
    (``pages``) only once it has persisted ``DriftConfig.page_steps`` and its drift accelerates.

    ``value``: the recent window's median; ``baseline``: the reference window's; ``z``: their gap in units of the
    reference's step-to-step spread (log scale); ``change``: value / baseline; ``since_step``: the first step of the
    drift (steps drifting = step − since_step); ``rate``: the drift per 100 of the series' values (steps, or measured
    steps under ``attention_every``) on the log scale over the recent window (positive: toward the danger)."""

    job: str
    rank: int
    step: int
    time_unix: float
    statistic: str  # STATISTICS
    layer: str
    head: int | None = None  # an attention head or an expert
    trend: Trend
    value: float
    baseline: float
    z: float
    change: float
    rate: float
    since_step: int
    pages: bool = False
    drivers: tuple[PrecursorDriver, ...] = ()
    detail: str = ""

    def __post_init__(self) -> None:
        if self.statistic not in STATISTICS:
            raise ValueError(f"precursor finding: statistic must be one of {list(STATISTICS)}, got {self.statistic!r}")
        object.__setattr__(self, "trend", Trend(self.trend))
        object.__setattr__(self, "drivers", tuple(self.drivers)[:MAX_DRIVERS])

    @property
    def steps_drifting(self) -> int:
        return self.step - self.since_step


__all__ = ["FALLING", "FALLING_STATISTICS", "MAX_DRIVERS", "RL_ENTROPY", "RL_KL", "STATISTICS", "UPDATE_RATIO",
           "PrecursorDriver", "PrecursorFinding", "Trend", "MAX_PRECURSORS", "MAX_PRECURSOR_LAYER", "PRECURSOR_MEANINGS", "PrecursorKind",
           "PrecursorStat", "precursor_problem"]
