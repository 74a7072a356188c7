"""Frozen records of the agent side: what the exporters, the store and the correlator exchange.

The trainer produces :class:`~gradloc.records.StepRecord` and per-rank
:class:`~gradloc.records.Incident`. The agent (in-process in embedded mode, the daemon otherwise)
works on two cheaper/wider forms:

* :class:`StepSummary` — one step of one rank with the per-layer statistics held as read-only numpy
  columns (a 256-layer record is 6 arrays, not 256 objects: the daemon ingests thousands per
  second). Built from a ``StepRecord`` by :func:`summarize` or decoded from the wire.
* :class:`CorrelatedIncident` — the records of every rank for one (job, step) merged into one
  incident: global → micro-batch → rank → sample → token spans, with the ranks that never
  reported named in ``ranks_missing``.

No tensors, no torch import: the daemon imports this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from gradloc.records import CulpritSpan, Incident, StepFields, StepRecord
from gradloc.records.summary import bare

CORRELATED_SCHEMA_VERSION = 1


def _frozen(values: object, dtype: type) -> np.ndarray:
    arr = np.asarray(values, dtype=dtype)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True)
class LayerColumns:
    """Per-layer statistics of one step as aligned read-only columns (index i = ``names[i]``).

    ``update_ratio`` is NaN where no ratio is known (first step, ratios off).
    """

    names: tuple[str, ...]
    grad_norm: np.ndarray  # float64 [L]
    grad_max_abs: np.ndarray  # float64 [L]
    nonfinite: np.ndarray  # int64 [L]
    param_norm: np.ndarray  # float64 [L]
    numel: np.ndarray  # int64 [L]
    update_ratio: np.ndarray  # float64 [L]

    @staticmethod
    def build(names: tuple[str, ...], grad_norm: object, grad_max_abs: object, nonfinite: object,
              param_norm: object, numel: object, update_ratio: object) -> "LayerColumns":
        cols = LayerColumns(tuple(names), _frozen(grad_norm, np.float64), _frozen(grad_max_abs, np.float64),
                            _frozen(nonfinite, np.int64), _frozen(param_norm, np.float64),
                            _frozen(numel, np.int64), _frozen(update_ratio, np.float64))
        n = len(cols.names)
        lengths = {len(a) for a in (cols.grad_norm, cols.grad_max_abs, cols.nonfinite, cols.param_norm,
                                    cols.numel, cols.update_ratio)}
        if lengths != {n}:
            raise ValueError(f"layer columns have lengths {sorted(lengths)}, expected {n} (one per layer name)")
        return cols

    def __len__(self) -> int:
        return len(self.names)


@dataclass(frozen=True, kw_only=True)
class StepSummary(StepFields):
    """One optimizer step of one rank, as the agent sees it: a :class:`StepRecord`'s fields
    (``records.StepFields``) with the per-layer statistics as columns."""

    layers: LayerColumns
    events_dropped: int = 0  # decoded from the wire: entries dropped as invalid (the agent counts them)
    groups_dropped: int = 0  # decoded from the wire: data groups dropped as invalid (the agent counts them)
    precursors_dropped: int = 0  # decoded from the wire: precursor stats dropped as invalid (the agent counts them)
    precursor_findings_dropped: int = 0  # decoded from the wire: drift findings dropped as invalid (counted likewise)


def summarize(record: StepRecord) -> StepSummary:
    """The agent-side form of a trainer's :class:`StepRecord` (embedded mode; once per step)."""
    ls = record.layers
    nan = float("nan")
    cols = LayerColumns.build(
        tuple(s.layer for s in ls), [s.grad_norm for s in ls], [s.grad_max_abs for s in ls],
        [s.nonfinite for s in ls], [s.param_norm for s in ls], [s.numel for s in ls],
        [nan if s.update_ratio is None else s.update_ratio for s in ls])
    return StepSummary(**{f.name: getattr(record, f.name) for f in fields(StepFields)}, layers=cols)


@dataclass(frozen=True)
class RankShare:
    """One rank's part of a correlated incident.

    ``share`` is the rank's part of the per-token attribution score summed over all reporting ranks
    (None when the rank sent no token statistics). ``flagged`` says whether the rank's own detector
    raised an incident for the step; ``status`` is its localization status (or "" when it did not
    localize).
    """

    rank: int
    share: float | None
    global_norm: float | None
    loss: float | None
    flagged: bool
    status: str = ""
    probes: int = 0


@dataclass(frozen=True)
class MicroBatchShare:
    """Share of the step's attribution score in one micro-batch of one rank (global, sums to ≤1)."""

    rank: int
    micro_batch: int
    share: float


@dataclass(frozen=True)
class RankSpan:
    """A culprit span found on one rank; ``share`` is its global share (rank share × span share)."""

    rank: int
    share: float
    span: CulpritSpan


@dataclass(frozen=True, kw_only=True)
class StepPoint:
    """One step of one rank as the incident page charts it: its global norm and loss, and the detector's
    healthy band it was judged against (``StepRecord.norm_mean``/``norm_threshold``; None during the
    detector's warm-up or from a client without them). ``global_norm`` is NaN when unknown."""

    rank: int
    step: int
    global_norm: float
    loss: float | None = None
    norm_mean: float | None = None
    norm_threshold: float | None = None


@dataclass(frozen=True)
class CorrelatedIncident:
    """One incident per (job, step), across ranks.

    ``status``: "complete" when every expected rank reported the step, "partial" when the straggler
    deadline passed first (``ranks_missing`` names the ranks that never reported).
    ``trace_id`` (32 hex digits) is the incident's OTLP trace; metric exemplars carry it.
    """

    incident_id: str
    trace_id: str
    job: str
    step: int
    time_unix: float
    status: str
    kinds: tuple[str, ...]
    global_norm: float
    ranks_expected: tuple[int, ...]
    ranks_reported: tuple[int, ...]
    ranks_missing: tuple[int, ...]
    rank_shares: tuple[RankShare, ...]
    micro_batch_shares: tuple[MicroBatchShare, ...]
    spans: tuple[RankSpan, ...]
    findings: tuple[Incident, ...]  # the per-rank incidents as the ranks sent them
    closed_unix: float = 0.0
    note: str = ""
    schema_version: int = CORRELATED_SCHEMA_VERSION
    explained_share: float | None = None  # best verified explained share over the ranks
    probes: int = 0  # probes summed over ranks
    top_layers: tuple[str, ...] = field(default=())  # layers the detector flagged, any rank
    # the steps the agent held of one reporting rank (the lowest that sent a finding) up to the incident's:
    # what the incident page charts (empty: an incident stored before this field, or no step records)
    history: tuple[StepPoint, ...] = field(default=())

    @property
    def follows(self) -> int | None:
        """The step of the incident whose episode this one was opened in, as a new cause
        (``SpikeEvent.follows`` of its findings: the job's verdict, the same on every rank); None otherwise."""
        return next((f.spike.follows for f in self.findings if f.spike.follows is not None), None)

    @property
    def last_healthy_step(self) -> int | None:
        """The last step before the incident's episode that every reporting rank found healthy (the earliest of
        their ``SpikeEvent.last_healthy_step``): roll back to a checkpoint saved at or before it. None: unknown."""
        steps = [f.spike.last_healthy_step for f in self.findings if f.spike.last_healthy_step is not None]
        return min(steps) if steps else None

    def summary(self) -> str:
        """The answer in one line: the id's first 12 hex digits (what the trainer, the store and the page
        show; any prefix resolves), job, step and :meth:`answer`."""
        return f"incident {bare(self.incident_id[:12])} · job {bare(self.job)} · step {self.step}: {self.answer()}"

    def answer(self) -> str:
        """``Localization.summary()`` of the lowest reporting rank that localized (a job-scope incident's
        finding holds the whole job's answer)."""
        f = next((f for f in sorted(self.findings, key=lambda f: f.rank) if f.localization is not None), None)
        if f is None:
            return f"{', '.join(self.kinds) or 'nothing'} · not localized"
        return f.localization.summary(f.scope == "job")

    @property
    def detail(self) -> str:
        """The detector's detail of the lowest reporting rank's finding that has one ("" without)."""
        return next((f.spike.detail for f in sorted(self.findings, key=lambda f: f.rank) if f.spike.detail), "")
