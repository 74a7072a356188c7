"""The step's slots (collector/precursors/slots.py) as records: one :class:`PrecursorStat` per kind and module,
and per head or expert where configured. A value that is not finite (non-finite logits: the nonfinite path reports
them) is left out and counted, never recorded."""
from __future__ import annotations

from collections import Counter

import numpy as np

from gradloc.collector.precursors.job import JobSlots
from gradloc.collector.precursors.slots import SlotKey, SlotValues, unpack
from gradloc.config import PrecursorConfig
from gradloc.records.precursors import PrecursorKind as K
from gradloc.records.precursors import PrecursorStat

_FIRST = (K.LOGIT_MAX_ABS, K.LOGIT_LSE_SQ, K.RESIDUAL_RMS)  # the model's own: first, before any per-module value


def to_stats(values: dict[SlotKey, SlotValues], per_head: bool, counters: Counter[str]) -> tuple[PrecursorStat, ...]:
    """In the order a series bound (StateConfig.max_layers) should keep them: the head's and the final norm's,
    then one per module and kind (in forward order), then the per-head and per-expert values."""
    out: list[PrecursorStat] = []

    rank: int | None = None  # the slot's: where its extreme (``at``) was, in a job's values

    def add(kind: K, layer: str, value: float, head: int | None = None,
            at: tuple[int, int, int] | None = None) -> None:
        if np.isfinite(value):
            out.append(PrecursorStat(kind=kind, layer=layer, value=float(value), head=head, at=at,
                                     rank=rank if at is not None else None))
        else:
            counters["precursors_nonfinite"] += 1

    for key, v in values.items():
        if v.count <= 0 and not np.isfinite(v.extreme):  # nothing folded into it (a compiled graph's accumulator)
            continue
        rank = v.rank
        if key.stat == "attn_max_logit":
            add(K.ATTN_MAX_LOGIT, key.layer, v.extreme, at=v.at)
            for h, x in enumerate(v.value if per_head else ()):
                add(K.ATTN_MAX_LOGIT, key.layer, x, head=h)
        elif key.stat == "attn_entropy":
            H = key.size // 2
            rows = v.value[H:]  # (2H,) -> sums (H,) | rows (H,)
            if not (rows > 0).any():
                continue
            mean = np.where(rows > 0, v.value[:H] / np.maximum(rows, 1), np.inf)  # (H,)
            add(K.ATTN_ENTROPY, key.layer, float(mean.min()), at=v.at)
            for h, x in enumerate(mean if per_head else ()):
                if rows[h] > 0:
                    add(K.ATTN_ENTROPY, key.layer, x, head=h)
        elif key.stat == "logit_max_abs":
            add(K.LOGIT_MAX_ABS, key.layer, v.extreme, at=v.at)
        elif key.stat == "logit_lse_sq" and v.count > 0:
            add(K.LOGIT_LSE_SQ, key.layer, v.value[0] / v.count)
        elif key.stat == "residual_rms" and v.count > 0:
            add(K.RESIDUAL_RMS, key.layer, v.value[0] / v.count, at=v.at)
        elif key.stat == "router" and v.count > 0:
            counts = v.value[1:]  # (1 + E,) -> (E,)
            add(K.ROUTER_ENTROPY, key.layer, v.value[0] / v.count)
            mean = counts.mean()
            if mean > 0:
                add(K.EXPERT_LOAD_MAX, key.layer, float(counts.max() / mean))
                for e, c in enumerate(counts if per_head else ()):
                    add(K.EXPERT_LOAD_MAX, key.layer, float(c / mean), head=e)
            add(K.DEAD_EXPERTS, key.layer, float((counts == 0).sum()))
        elif key.stat == "attn_unmatched" and v.count > 0:  # compiled.TracedAttention: calls not measured
            counters["precursors_unsupported"] += int(v.count)
    rank = {k: i for i, k in enumerate(_FIRST)}
    return tuple(sorted(out, key=lambda p: (p.head is not None, rank.get(p.kind, len(rank)))))  # stable


def precursor_stats(taken: tuple[tuple[SlotKey, ...], object] | None, host: np.ndarray | None, cfg: PrecursorConfig,
                    counters: Counter[str], job: JobSlots | None = None,
                    rows: np.ndarray | None = None) -> tuple[tuple[PrecursorStat, ...], bool]:
    """The step's records from ``StepSlots.take``'s keys and the host copy of its pack (none: nothing measured), and
    whether they are the job's: in a multi-rank job (``job``, with the step gather's precursor ``rows``) every rank's
    slots combined, once the ranks agreed on their layout (collector/precursors/job.py)."""
    keys = taken[0] if taken is not None else ()
    if job is not None:
        values, job_wide = job.values(keys, host, rows)
    else:
        values, job_wide = (unpack(keys, host) if keys and host is not None else {}), False
    return (to_stats(values, cfg.per_head, counters) if values else ()), job_wide


__all__ = ["precursor_stats", "to_stats"]
