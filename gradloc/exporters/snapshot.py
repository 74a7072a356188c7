"""What the exporters read: a :class:`TelemetrySnapshot` of the :class:`~gradloc.exporters.state.TelemetryState`.

Frozen points (a rank's latest step, counters, histograms, their exemplars) and the rules both
exporters apply to them: which per-rank gauges a step gives, which are the job's (one series with
``rank="job"`` where the layer columns are global), and which metric keys belong to a job or a rank
(what forgetting one removes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

from gradloc.exporters.metric_specs import SPECS
from gradloc.records import SHED_FEATURES
from gradloc.reports import StepSummary

Labels = tuple[str, ...]

# The per-rank gauges, read from a rank's latest StepSummary (None = no series); both exporters use these.
RANK_GAUGES: dict[str, Callable[[StepSummary], float | None]] = {
    "global_norm": lambda s: s.global_norm,
    "loss": lambda s: s.loss,
    "step": lambda s: s.step,
    "record_time": lambda s: s.time_unix,
    "token_top_share": lambda s: None if s.tokens is None else s.tokens.top_share,
    "unattributed": lambda s: None if s.tokens is None else s.tokens.unattributed_share,
    "grad_scale": lambda s: s.grad_scale,
    "nonfinite": lambda s: s.nonfinite,
    "overhead": lambda s: s.overhead,
    "rl_mismatch": lambda s: None if s.rl is None else s.rl.mismatch_fraction,
    "rl_clipped": lambda s: None if s.rl is None else s.rl.clip_fraction,
    "rl_entropy": lambda s: None if s.rl is None else s.rl.entropy_mean,
    "rl_kl_rollout": lambda s: None if s.rl is None else s.rl.kl_rollout,
    "rl_job_entropy": lambda s: None if s.rl is None else s.rl.job_entropy_mean,
    "rl_job_kl_rollout": lambda s: None if s.rl is None else s.rl.job_kl_rollout,
    "rl_mismatch_baseline": lambda s: None if s.samples is None else s.samples.rl_mismatch_baseline,
    "norm_mean": lambda s: s.norm_mean,
    "norm_threshold": lambda s: s.norm_threshold,
    # the window maxima read the latest step only where no window was kept (RankPoint.window_max)
    "global_norm_max": lambda s: s.global_norm,
    "loss_max": lambda s: s.loss,
}
# window key -> the per-step value whose maximum between two collections it exports (TelemetryState.snapshot)
WINDOW_GAUGES: dict[str, str] = {"global_norm_max": "global_norm", "loss_max": "loss"}
WINDOW_READERS = ("prometheus", "otlp")  # each exporter collects its own windows (one never empties another's)


def widen_window(window: dict[str, float], s: StepSummary) -> None:
    """Fold one step into a rank's window maxima (a NaN step keeps the window NaN: a NaN norm must show)."""
    for key, base in WINDOW_GAUGES.items():
        v = RANK_GAUGES[base](s)
        if v is None:
            continue
        v, old = float(v), window.get(key)
        window[key] = v if old is None or math.isnan(v) or (not math.isnan(old) and v > old) else old


# Where a step's layer columns are the job's (DDP, FSDP2, ZeRO: ``StepSummary.layers_global``), these
# and the layer series are the same on every rank: exported once, from rank 0, with rank="job".
JOB_GAUGES = frozenset({"global_norm", "global_norm_max", "nonfinite", "norm_mean", "norm_threshold"})
JOB_RANK = "job"


def rl_ratio_values(s: StepSummary) -> list[tuple[str, float]]:
    """(reference, max |log-ratio|) for the ratios the step's RL fields gave."""
    if s.rl is None:
        return []
    pairs = (("rollout", s.rl.max_abs_log_ratio), ("old", s.rl.max_abs_log_ratio_old))
    return [(ref, v) for ref, v in pairs if v is not None]


def shed_values(s: StepSummary) -> list[tuple[str, float]]:
    """(feature, 1.0 shed / 0.0 not) for every known feature: a bounded label set."""
    return [(f, 1.0 if f in s.shed else 0.0) for f in SHED_FEATURES]


@dataclass(frozen=True)
class Exemplar:
    trace_id: str  # 32 hex digits
    value: float
    time_unix: float


@dataclass(frozen=True)
class CounterPoint:
    key: str
    labels: Labels  # values, in the spec's label order
    value: float
    exemplar: Exemplar | None = None


@dataclass(frozen=True)
class HistogramPoint:
    key: str
    labels: Labels
    counts: tuple[int, ...]  # per bucket (not cumulative), len(buckets) + 1 (the last is +Inf)
    sum: float
    count: int
    exemplars: tuple[Exemplar | None, ...] = ()  # per bucket, like OpenMetrics


@dataclass(frozen=True)
class RankPoint:
    """The series one latest step record gives.

    ``scope``: "all" (a rank watched on its own: every gauge and layer series under its rank),
    "rank" (a rank of a job whose layer columns are global: only its own gauges — loss, tokens,
    overhead, RL, shed — no layer series), "job" (the job-level part, from rank 0: the layer series
    and :data:`JOB_GAUGES` under rank="job")."""

    summary: StepSummary
    received_unix: float
    layers_exported: int  # the first n layers have series (bounded by max_layers)
    scope: str = "all"
    precursors_exported: int = 0  # the first n precursor stats have series (bounded by max_layers)
    # (WINDOW_GAUGES key, max) over the steps since the reading exporter's previous collection; empty: the
    # latest step's values (no step since, or a snapshot taken without a reader)
    window_max: tuple[tuple[str, float], ...] = ()

    @property
    def rank_label(self) -> str:
        return JOB_RANK if self.scope == "job" else str(self.summary.rank)

    def gauges(self) -> Iterator[tuple[str, float]]:
        """(RANK_GAUGES key, value) of the per-rank gauges this point exports (None values left out)."""
        window = dict(self.window_max)
        for key, get in RANK_GAUGES.items():
            if (self.scope == "job") != (key in JOB_GAUGES) and self.scope != "all":
                continue
            value = window[key] if key in window else get(self.summary)
            if value is not None:
                yield key, value

    @property
    def own(self) -> bool:
        """Whether the rank's own series (shed, RL ratios) come from this point."""
        return self.scope != "job"


# The keys whose series belong to one job (first label ``job``), and to one rank of it (``job``, ``rank``).
JOB_KEYS = frozenset(s.key for s in SPECS if s.labels[:1] == ("job",))
RANK_KEYS = frozenset(s.key for s in SPECS if s.labels[:2] == ("job", "rank"))


def norm_hist_labels(s: StepSummary) -> Labels | None:
    """Labels of the global-norm histogram observation of a step (None: not observed here — a job's
    norm is observed once, from rank 0)."""
    if not s.layers_global:
        return (s.job, str(s.rank))
    return (s.job, JOB_RANK) if s.rank == 0 else None


@dataclass(frozen=True)
class TelemetrySnapshot:
    time_unix: float
    ranks: tuple[RankPoint, ...]
    counters: tuple[CounterPoint, ...]
    histograms: tuple[HistogramPoint, ...]
    pending: int = 0
    queued: int = 0  # ingest batches waiting for the agent's pipeline
