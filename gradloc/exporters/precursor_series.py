"""The precursor statistics of a rank's latest step as series (records/precursors.py): one gauge per kind and
module (label ``layer``), per head (``head``) or expert (``expert``) only where the monitor measured them so
(PrecursorConfig.per_head). Both exporters read them from here; the state bounds how many a rank exports."""
from __future__ import annotations

from collections.abc import Iterator

from gradloc.exporters.snapshot import RankPoint
from gradloc.records.precursors import PrecursorKind as K

# the gauge of each kind's module-level value (spec key = the kind's name), and of its per-head values
_PER_HEAD = {K.ATTN_MAX_LOGIT: ("attn_head_max_logit", "head"), K.ATTN_ENTROPY: ("attn_head_entropy", "head"),
             K.EXPERT_LOAD_MAX: ("expert_load", "expert")}
PRECURSOR_KEYS = frozenset({k.value for k in K} | {key for key, _ in _PER_HEAD.values()})


def precursor_points(p: RankPoint) -> Iterator[tuple[str, dict[str, str], float]]:
    """(spec key, labels beside job and rank, value) of a point's exported precursor stats (a rank's own point:
    they are the rank's values)."""
    if not p.own:
        return
    for stat in p.summary.precursors[:p.precursors_exported]:
        if stat.head is None:
            yield stat.kind.value, {"layer": stat.layer}, stat.value
        elif stat.kind in _PER_HEAD:
            key, label = _PER_HEAD[stat.kind]
            yield key, {"layer": stat.layer, label: str(stat.head)}, stat.value


__all__ = ["PRECURSOR_KEYS", "precursor_points"]
