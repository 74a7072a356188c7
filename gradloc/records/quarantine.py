"""The quarantine: samples (by id or origin) and whole sources kept out of the next run.

One :class:`QuarantineEntry` per (kind, value). The store keeps the list (``store/quarantine.py``), the CLI edits
and exports it (``gradloc-agent quarantine``), and the loader-side helpers read an export — one JSON object per
line, ``to_dict`` of an entry — so that a resumed run never sees those samples again
(``gradloc/integrations/quarantine.py``).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from gradloc.records.provenance import MAX_ORIGIN, MAX_SOURCE
from gradloc.records.steps import to_dict

MAX_VALUE = max(MAX_ORIGIN, MAX_SOURCE, 256)  # characters of an entry's value (a sample id: at most 256)
MAX_REASON = 1024


class QuarantineKind(StrEnum):
    SAMPLE = "sample"  # a sample id (Culprit.sample_id, SampleOutlier.sample_id)
    ORIGIN = "origin"  # SampleInfo.origin: "file:row"
    SOURCE = "source"  # SampleInfo.source: a whole mixture component


LIMITS = {QuarantineKind.SAMPLE: 256, QuarantineKind.ORIGIN: MAX_ORIGIN, QuarantineKind.SOURCE: MAX_SOURCE}


@dataclass(frozen=True, kw_only=True)
class QuarantineEntry:
    kind: QuarantineKind
    value: str
    reason: str = ""  # why: "by hand", or the incident or outlier that put it there
    added_unix: float = 0.0
    job: str | None = None  # the job whose incident or outlier named it (None: by hand)
    step: int | None = None
    incident_id: str | None = None

    def __post_init__(self) -> None:
        problem = entry_problem(self.kind, self.value, self.reason)
        if problem:
            raise ValueError(f"quarantine entry: {problem}")
        object.__setattr__(self, "kind", QuarantineKind(self.kind))


def entry_problem(kind: object, value: object, reason: object) -> str:
    """Why (kind, value, reason) is not a valid entry ('' when it is)."""
    if kind not in tuple(QuarantineKind):
        return f"kind must be one of {[k.value for k in QuarantineKind]}, got {kind!r}"
    limit = LIMITS[QuarantineKind(kind)]
    if not isinstance(value, str) or not value or len(value) > limit:
        return f"a {kind} value must be a non-empty string of at most {limit} characters"
    if not isinstance(reason, str) or len(reason) > MAX_REASON:
        return f"reason must be a string of at most {MAX_REASON} characters"
    return ""


def entries_jsonl(entries: Iterable[QuarantineEntry]) -> str:
    """The export format: one JSON object per entry and line (``gradloc-agent quarantine export``,
    ``QuarantineList.save``); :func:`parse_jsonl` reads it back."""
    return "".join(json.dumps(to_dict(e), ensure_ascii=False) + "\n" for e in entries)


def parse_jsonl(lines: Iterable[str]) -> tuple[list[QuarantineEntry], list[tuple[int, str]]]:
    """The entries of an export, and (line number, why) for each line that is not one (never guessed)."""
    entries, bad = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            entries.append(QuarantineEntry(kind=d["kind"], value=d["value"], reason=d.get("reason", ""),
                                           added_unix=float(d.get("added_unix", 0.0)), job=d.get("job"),
                                           step=d.get("step"), incident_id=d.get("incident_id")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            bad.append((n, str(exc)))
    return entries, bad


__all__ = ["LIMITS", "MAX_REASON", "QuarantineEntry", "QuarantineKind", "entries_jsonl", "entry_problem",
           "parse_jsonl"]
