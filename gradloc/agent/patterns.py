"""Which kinds of data spike: culprits and outliers per data group, divided by the data each group contributed.

One pass over the store's window: every incident's culprit spans and every stored outlier are put in their groups
(the sample's source and tags from its SampleInfo; the length bucket of an outlier's judged tokens; derived from
the flag itself: the position bucket, the token class of its text, an RL incident's class), and each group's
tokens come from the steps' own counts (``StepSummary.groups``, gradloc/store/groups.py). A group's **rate** is
(culprit spans + outliers) per million of its tokens: a source that contributes half the tokens and holds half the
flags is not a pattern; one with 3% of the tokens and half the flags is. Derived kinds (position, token class, RL
class) have no per-step token count: they get shares, not rates. Nothing here imports torch.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gradloc.records import ClassKind, SampleInfo, SampleOutlier
from gradloc.records.groups import NO_SOURCE, GroupKind, length_bucket, position_bucket, token_class
from gradloc.reports import CorrelatedIncident

KINDS = tuple(k.value for k in GroupKind)
RL_CLASSES = frozenset({ClassKind.TRAIN_INFERENCE_MISMATCH, ClassKind.LOW_PROB_HIGH_ADVANTAGE, ClassKind.STALE_OFF_POLICY})


@dataclass(frozen=True, kw_only=True)
class PatternRow:
    """One data group over the window."""

    kind: str
    name: str
    samples: int  # samples the group contributed (0: not counted per step for this kind)
    tokens: int  # their loss tokens
    incidents: int  # incidents with at least one culprit span in the group
    culprits: int  # culprit spans in the group
    outliers: int  # outlier samples in the group
    flag_share: float  # the group's share of the kind's culprits + outliers
    token_share: float | None  # the group's share of the kind's tokens (None: not counted)
    per_million: float | None  # (culprits + outliers) per million tokens (None: not counted)


@dataclass(frozen=True, kw_only=True)
class Patterns:
    job: str | None
    since_unix: float | None
    until_unix: float | None
    incidents: int  # incidents in the window
    culprits: int  # their culprit spans
    outliers: int  # outliers in the window
    rows: tuple[PatternRow, ...] = field(default=())

    def of(self, kind: str) -> tuple[PatternRow, ...]:
        """The rows of one kind, highest rate first (then most flags)."""
        return tuple(r for r in self.rows if r.kind == kind)


@dataclass
class _Acc:
    incidents: set[str] = field(default_factory=set)
    culprits: int = 0
    outliers: int = 0


def _info_groups(info: SampleInfo | None) -> list[tuple[str, str]]:
    keys = [(GroupKind.SOURCE.value, (info.source if info else None) or NO_SOURCE)]
    return keys + [(GroupKind.TAG.value, f"{k}={v}") for k, v in (info.tags if info else ())]


def compute(incidents: Iterable[CorrelatedIncident], outliers: Iterable[SampleOutlier],
            totals: Iterable[tuple[str, str, int, int]], *, job: str | None = None, since_unix: float | None = None,
            until_unix: float | None = None) -> Patterns:
    """The window's patterns from its incidents, outliers and group totals ((kind, name, samples, tokens))."""
    acc: dict[tuple[str, str], _Acc] = defaultdict(_Acc)
    n_inc = n_culprits = n_out = 0
    for inc in incidents:
        n_inc += 1
        rl_classes = {f.classification.kind for f in inc.findings
                      if f.classification is not None and f.classification.kind in RL_CLASSES}
        for rs in inc.spans:
            s = rs.span
            n_culprits += 1
            keys = _info_groups(s.sample_info) + [(GroupKind.POSITION.value, position_bucket(s.start)),
                                                  (GroupKind.TOKEN_CLASS.value, token_class(s.text))]
            keys += [(GroupKind.RL_CLASS.value, str(c)) for c in sorted(rl_classes)]
            for key in dict.fromkeys(keys):
                a = acc[key]
                a.culprits += 1
                a.incidents.add(inc.incident_id)
    for o in outliers:
        if o.kind != "surprise":  # an RL mismatch finding is a step's, not a sample's
            continue
        n_out += 1
        keys = _info_groups(o.sample_info) + [(GroupKind.LENGTH.value, length_bucket(o.tokens)),
                                              (GroupKind.TOKEN_CLASS.value, token_class(o.text))]
        if o.start is not None:
            keys.append((GroupKind.POSITION.value, position_bucket(o.start)))
        for key in dict.fromkeys(keys):
            acc[key].outliers += 1
    counted: dict[tuple[str, str], tuple[int, int]] = {(k, n): (a, b) for k, n, a, b in totals}
    kind_tokens: dict[str, int] = defaultdict(int)
    for (kind, _), (_, tokens) in counted.items():
        kind_tokens[kind] += tokens
    kind_flags: dict[str, int] = defaultdict(int)
    for (kind, _), a in acc.items():
        kind_flags[kind] += a.culprits + a.outliers
    rows = []
    for key in sorted(set(acc) | set(counted)):
        kind, name = key
        a, (samples, tokens) = acc.get(key, _Acc()), counted.get(key, (0, 0))
        flags = a.culprits + a.outliers
        has_tokens = kind in kind_tokens
        rows.append(PatternRow(
            kind=kind, name=name, samples=samples, tokens=tokens, incidents=len(a.incidents), culprits=a.culprits,
            outliers=a.outliers, flag_share=flags / kind_flags[kind] if kind_flags[kind] else 0.0,
            token_share=tokens / kind_tokens[kind] if has_tokens and kind_tokens[kind] else None,
            per_million=flags * 1e6 / tokens if has_tokens and tokens else None))
    rows.sort(key=lambda r: (KINDS.index(r.kind) if r.kind in KINDS else len(KINDS),
                             -(r.per_million if r.per_million is not None else -1.0), -(r.culprits + r.outliers),
                             r.name))
    return Patterns(job=job, since_unix=since_unix, until_unix=until_unix, incidents=n_inc, culprits=n_culprits,
                    outliers=n_out, rows=tuple(rows))


def from_store(store: Any, *, job: str | None = None, since_unix: float | None = None,
               until_unix: float | None = None) -> Patterns:
    """:func:`compute` over one store's window (any job when ``job`` is None; ``until_unix`` exclusive)."""
    def within(t: float) -> bool:
        return until_unix is None or t < until_unix

    incidents = (i for i in store.iter_incidents(job=job, since_unix=since_unix) if within(i.time_unix))
    outliers = (o for o in store.list_outliers(job=job, since_unix=since_unix, limit=None) if within(o.time_unix))
    return compute(incidents, outliers, store.history.group_totals(job, since_unix, until_unix), job=job,
                   since_unix=since_unix, until_unix=until_unix)


def from_dict(data: dict[str, Any]) -> Patterns:
    """The :class:`Patterns` of its JSON form (``records.to_dict``: what ``/api/patterns`` serves)."""
    def num(x: Any) -> float | None:
        return None if x is None else float(x)

    rows = tuple(PatternRow(**{**r, "flag_share": float(r["flag_share"]), "token_share": num(r["token_share"]),
                               "per_million": num(r["per_million"])}) for r in data["rows"])
    return Patterns(**{**{k: v for k, v in data.items() if k != "rows"}, "rows": rows})


__all__ = ["KINDS", "PatternRow", "Patterns", "compute", "from_dict", "from_store"]
