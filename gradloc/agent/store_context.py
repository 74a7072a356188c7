"""What the store knows around one incident, read once for its page and its CLI text: the steps around it (the
charts), the incident whose episode it follows, the samples it quarantined, the drift findings of series that were
drifting before it, and memory across runs — each culprit sample's earlier flags (by origin or sample id, any job) and
its source's flags in other jobs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from gradloc.agent.page_chart import episode_opener, page_steps
from gradloc.agent.page_precursors import PRECEDE_STEPS, preceding
from gradloc.reports import CorrelatedIncident
from gradloc.store.history import SeenBefore, SourceBefore


_MAX_FINDINGS = 1_000  # drift findings read around one incident (newest first)


@dataclass(frozen=True, kw_only=True)
class StoreContext:
    steps: tuple[Any, ...] = ()  # the store's step rows around the incident (page_chart.page_steps)
    opener_id: str | None = None  # a new-cause incident: the incident whose episode it follows
    quarantined: tuple[Any, ...] = ()  # the QuarantineEntry rows this incident put on the list
    seen: Mapping[str, SeenBefore] = field(default_factory=dict)  # a culprit's origin (else sample id) -> earlier flags
    sources: tuple[SourceBefore, ...] = ()  # its culprits' sources flagged in other jobs
    preceded: tuple[Any, ...] = ()  # PrecursorFinding: one per series drifting before it (page_precursors.preceding)


def store_context(store: Any, inc: CorrelatedIncident, *, steps: bool = True) -> StoreContext:
    """The context of ``inc`` in ``store`` (None: an empty context); ``steps=False`` skips the chart rows."""
    if store is None:
        return StoreContext()
    seen: dict[str, SeenBefore] = {}
    for rs in inc.spans:
        info = rs.span.sample_info
        found = store.history.seen_before(origin=info.origin if info else None, sample_id=rs.span.sample_id,
                                          before_unix=inc.time_unix, exclude_incident=inc.incident_id)
        if found is not None:
            seen[found.key] = found
    names = dict.fromkeys(rs.span.sample_info.source for rs in inc.spans
                          if rs.span.sample_info is not None and rs.span.sample_info.source)
    sources = tuple(s for s in (store.history.source_before(source=name, before_unix=inc.time_unix, job=inc.job)
                                for name in names) if s is not None)
    found = store.list_precursor_findings(job=inc.job, limit=_MAX_FINDINGS, steps=(inc.step - PRECEDE_STEPS, inc.step))
    return StoreContext(steps=tuple(page_steps(store, inc)) if steps else (), opener_id=episode_opener(store, inc),
                        quarantined=tuple(store.quarantine.list(incident_id=inc.incident_id)), seen=seen,
                        sources=sources, preceded=preceding(found, inc.job, inc.step))
