"""The lists beside a step record on the wire — the monitor's event counts, the data groups, the precursor
statistics: an invalid entry is dropped and counted, never the step (transport/codec_steps.py decodes the rest)."""
from __future__ import annotations

import math

from gradloc.records.events import MAX_EVENT_NAME, MAX_EVENTS
from gradloc.records.groups import MAX_GROUPS, STEP_KINDS, GroupTokens, group_problem
from gradloc.records.precursors import MAX_PRECURSORS, PrecursorStat, precursor_problem
from gradloc.transport.wire import pb


def precursors_of(m: pb.Step) -> tuple[tuple[PrecursorStat, ...], int]:
    """The step's precursor statistics: an entry of an unknown kind, a too long layer name, a negative head, a
    non-finite value or a location that is not three counts is dropped (not the step), and so is every valid one
    after the first MAX_PRECURSORS; returns (stats, entries dropped)."""
    kept = []
    for p in m.precursors:
        head = p.head if p.HasField("head") else None
        at = tuple(p.at) if p.at else None
        rank = p.rank if p.HasField("rank") else None
        if len(kept) < MAX_PRECURSORS and math.isfinite(p.value) and \
                not precursor_problem(p.kind, p.layer, head, at, rank):
            kept.append(PrecursorStat(kind=p.kind, layer=p.layer, value=p.value, head=head, at=at, rank=rank))
    return tuple(kept), len(m.precursors) - len(kept)


def groups_of(m: pb.Step) -> tuple[tuple[GroupTokens, ...], int]:
    """The step's data groups: an entry of an unknown kind, an empty or too long name or a negative count is dropped
    (not the step), and so is every valid one after the first MAX_GROUPS; returns (groups, entries dropped)."""
    kept = tuple(GroupTokens(kind=g.kind, name=g.name, samples=g.samples, tokens=g.tokens) for g in m.groups
                 if g.kind in STEP_KINDS and not group_problem(g.name, g.samples, g.tokens))[:MAX_GROUPS]
    return kept, len(m.groups) - len(kept)


def events_of(m: pb.Step) -> tuple[tuple[tuple[str, int], ...], int]:
    """The monitor's event counts, sorted by name: an entry with an empty name or one longer than
    MAX_EVENT_NAME, or a negative count, is dropped (not the step: they are counters beside it), and so
    is every valid one after the first MAX_EVENTS; returns (events, entries dropped)."""
    valid = sorted((k, n) for k, n in m.events.items() if 0 < len(k) <= MAX_EVENT_NAME and n >= 0)
    kept = tuple(valid[:MAX_EVENTS])
    return kept, len(m.events) - len(kept)


__all__ = ["events_of", "groups_of", "precursors_of"]
