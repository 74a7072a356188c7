"""A job's precursor values: every rank's step slots (collector/precursors/slots.py) combined slot by slot, so that
the drift detector judges the job, not one rank's share of its data.

Under data parallelism (DDP, FSDP2, ZeRO) every rank runs the same modules on its own micro-batches: the job's
largest attention logit is the largest over the ranks, its mean row entropy the ranks' sums over their summed rows,
an expert's load the ranks' token counts summed, the head's mean logsumexp² the summed sums over the summed counts.
The slots ride the step's one gather (collector/job.py), whose rows must have one size on every rank:

- each rank keeps every slot it has filled (``known``, in one order whatever order a rank first filled them in:
  by module name, its numbers compared as numbers — forward order in a stack of layers) and sends a descriptor of
  them each step: [values, CRC-32 of their keys];
- its values travel in the *agreed* layout — the known slots of the last step on which every rank sent the same
  descriptor — slots it did not fill this step at their identity (``slots.identity``: they change nothing);
- on the host every rank sees the same rows, so every rank decides the same: when every descriptor is the agreed
  one, the job's values (a slot that no rank filled this step is left out); otherwise the rank's own values for this
  step and, when the descriptors are all equal, a new agreement from the next step. The first step or two of a run
  (the head is found at the end of the first micro-batch) are judged on a rank's own values; steps whose
  descriptors differ are counted (``precursors_own_values``).

Under tensor parallelism a rank measures its block of each layer's heads (laid side by side in tp order: exact) and,
with a vocabulary-parallel head, its shard's logsumexps (combined per position over the shards: see
``JobSlots._tensor_parallel``). A pipeline's
stages hook different modules: their layouts never agree, and each stage judges its own values (the counter says so
every step). A combined extreme keeps where it was and on which rank (``SlotValues.rank``): the
sample behind it is known to that rank only (engine/drift.py resolves the drivers it holds).
"""
from __future__ import annotations

import logging
import re
import zlib
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch

from gradloc.collector.precursors.slots import Reduce, SlotKey, SlotValues, identity, packed_size, unpack

log = logging.getLogger("gradloc")
DESCRIPTOR = 2  # [values of the known slots, CRC-32 of their keys]
_SPLIT = frozenset({"attn_max_logit", "attn_entropy"})  # per-head slots: a tp rank holds a block of the heads
_LSE = "logit_lse_sq"
_PARTS = "logit_lse_parts"  # under tp: the step's first head call's per-position logsumexps (module_stats.py)
# a vocabulary-split head's: on a rank's own values, its shard's (the largest |logit| too), not the layer's
_SHARD = frozenset({"logit_max_abs", _LSE, _PARTS})
_ROUTES = 16  # cached (own keys -> agreed layout) index pairs; a run has a few (attention_every alternates two)


def _order(key: SlotKey) -> tuple:
    """Module names with their numbers as numbers ("layers.2" before "layers.10"), then the statistic."""
    parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", key.layer) if p)
    return parts, key.stat, key.size, key.lowest


def describe(keys: tuple[SlotKey, ...]) -> tuple[float, float]:
    """The descriptor of a layout: its length and a CRC-32 of its keys (exact in float64)."""
    text = "|".join(f"{k.stat},{k.layer},{k.reduce.value},{k.size},{int(k.lowest)}" for k in keys)
    return float(sum(packed_size(k) for k in keys)), float(zlib.crc32(text.encode()))


@dataclass(frozen=True)
class _Layout:
    keys: tuple[SlotKey, ...]
    offsets: dict[SlotKey, int]
    by_max: np.ndarray  # positions combined by their largest value (a MAX slot's values, a highest extreme's)
    by_min: np.ndarray  # by their smallest (a lowest extreme's)
    by_sum: np.ndarray  # summed (a SUM slot's values, every count)
    extreme: np.ndarray  # (S,) each slot's extreme
    lowest: np.ndarray  # (S,) whether it is the smallest
    at: np.ndarray  # (S, 3) each slot's location: taken from the rank whose extreme won
    start: np.ndarray  # the layout's identity values

    @property
    def length(self) -> int:
        return len(self.start)


def _layout(keys: tuple[SlotKey, ...]) -> _Layout:
    offsets, pos = {}, 0
    by_max, by_min, by_sum, extreme, at, start = [], [], [], [], [], []
    for k in keys:
        offsets[k] = pos
        n = k.size
        (by_max if k.reduce is Reduce.MAX else by_sum).extend(range(pos, pos + n))
        by_sum.append(pos + n)  # the count
        (by_min if k.lowest else by_max).append(pos + n + 1)
        extreme.append(pos + n + 1)
        at.append(range(pos + n + 2, pos + n + 5))
        start.extend(identity(k))
        pos += packed_size(k)
    ints = dict(dtype=np.int64)
    return _Layout(keys, offsets, np.array(by_max, **ints), np.array(by_min, **ints), np.array(by_sum, **ints),
                   np.array(extreme, **ints), np.array([k.lowest for k in keys], dtype=bool),
                   np.array([list(r) for r in at], **ints).reshape(len(keys), 3), np.array(start, dtype=np.float64))


class JobSlots:
    """One rank's side of the agreement (``row`` before the step gather, ``values`` after its host transfer).

    ``tp``: each world rank's tensor-parallel coordinate and ``data`` its data index (None: no tensor parallelism,
    tests/distributed/test_precursors_job.py runs both)."""

    def __init__(self, counters: Counter[str], tp: Sequence[int] | None = None,
                 data: Sequence[int] | None = None) -> None:
        self.counters = counters
        self.tp = np.asarray(tp, dtype=np.int64) if tp is not None and max(tp, default=0) > 0 else None
        self.data = np.asarray(data, dtype=np.int64) if self.tp is not None else None
        self._said_vocab = False
        self.known: dict[SlotKey, None] = {}
        self.agreed = _layout(())
        self._agreed_descriptor = describe(())
        self._descriptor: torch.Tensor | None = None  # of ``known``, on the device
        self._start: torch.Tensor | None = None  # the agreed layout's identity, on the device
        self._routes: dict[tuple[SlotKey, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def row(self, keys: tuple[SlotKey, ...], pack: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """This rank's part of the step gather, (DESCRIPTOR + agreed length,) float64 on ``device``: the descriptor
        of its known slots, then this step's slots in the agreed layout. Host copies happen only when the known set
        or the agreement changes (cached), never on a step like the last. Never raises: a failure sends a NaN row of
        the agreed length (no rank agrees with it: every rank judges its own values this step), counted."""
        try:
            return self._row(keys, pack, device)
        except Exception:  # noqa: BLE001 - never raise into training
            self.counters["precursors_errors"] += 1
            log.warning("gradloc: the job's precursor row failed this step", exc_info=True)
            return torch.full((DESCRIPTOR + self.agreed.length,), float("nan"), dtype=torch.float64, device=device)

    def _row(self, keys: tuple[SlotKey, ...], pack: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        new = [k for k in keys if k not in self.known]
        if new:
            self.known = dict.fromkeys(sorted([*self.known, *new], key=_order))
        if new or self._descriptor is None or self._descriptor.device != device:
            self._descriptor = torch.tensor(describe(tuple(self.known)), dtype=torch.float64, device=device)
        if not self.agreed.keys:
            return self._descriptor
        if self._start is None or self._start.device != device:
            self._start = torch.from_numpy(self.agreed.start).to(device)
        values = self._start
        if pack is not None and keys:
            src, dst = self._route(keys, device)
            if src.numel():
                values = values.index_copy(0, dst, pack.detach().to(torch.float64)[src])  # (A,)
        return torch.cat([self._descriptor, values])

    def _route(self, keys: tuple[SlotKey, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each value of a pack of ``keys`` goes in the agreed layout (a key outside it goes nowhere: its
        rank's descriptor differs, and the step is judged per rank)."""
        got = self._routes.get(keys)
        if got is None or got[0].device != device:
            src, dst, pos = [], [], 0
            for k in keys:
                at = self.agreed.offsets.get(k)
                if at is not None:
                    src.extend(range(pos, pos + packed_size(k)))
                    dst.extend(range(at, at + packed_size(k)))
                pos += packed_size(k)
            if len(self._routes) >= _ROUTES:
                self._routes.clear()
            got = self._routes[keys] = (torch.tensor(src, dtype=torch.long, device=device),
                                        torch.tensor(dst, dtype=torch.long, device=device))
        return got

    def values(self, keys: tuple[SlotKey, ...], own: np.ndarray | None,
               rows: np.ndarray | None) -> tuple[dict[SlotKey, SlotValues], bool]:
        """The step's values to judge and whether they are the job's: ``own`` is this rank's pack (keys ``keys``),
        ``rows`` the gathered (W, DESCRIPTOR + agreed length) host rows (None: no gather this step)."""
        mine = unpack(keys, own) if keys and own is not None else {}
        if rows is None:
            return mine, False
        try:
            return self._values(mine, rows)
        except Exception:  # noqa: BLE001 - never raise into training
            self.counters["precursors_errors"] += 1
            log.warning("gradloc: the job's precursor values failed this step", exc_info=True)
            return {}, False

    def _values(self, mine: dict[SlotKey, SlotValues], rows: np.ndarray) -> tuple[dict[SlotKey, SlotValues], bool]:
        descriptors = rows[:, :DESCRIPTOR]  # (W, 2)
        same = bool((descriptors == descriptors[0]).all())
        if same and self.agreed.keys and tuple(descriptors[0]) == self._agreed_descriptor:
            return self._combine(rows[:, DESCRIPTOR:]), True
        if same and tuple(descriptors[0]) != self._agreed_descriptor:  # every rank knows these slots: agreed
            known = tuple(self.known)
            self.agreed, self._agreed_descriptor = _layout(known), describe(known)
            self._start, self._routes = None, {}
        if not same:  # an agreement being made is not counted: the ranks hook different modules, or a rank failed
            self.counters["precursors_own_values"] += 1
        if self.tp is not None:  # a rank's own share of split heads or a vocabulary shard is not the layer's
            mine = {k: v for k, v in mine.items() if k.stat not in _SPLIT and k.stat not in _SHARD}
        return mine, False

    def _combine(self, vals: np.ndarray) -> dict[SlotKey, SlotValues]:
        """(W, A) rows of the agreed layout -> the job's values by key, each extreme's rank kept."""
        lay = self.agreed
        out = np.empty(lay.length, dtype=np.float64)
        out[lay.by_max] = vals[:, lay.by_max].max(0)
        out[lay.by_min] = vals[:, lay.by_min].min(0)
        out[lay.by_sum] = vals[:, lay.by_sum].sum(0)
        ext = vals[:, lay.extreme]  # (W, S)
        win = np.argmax(np.where(lay.lowest, -ext, ext), axis=0)  # (S,) the rank whose extreme is the job's
        out[lay.at] = vals[win[:, None], lay.at]  # (S, 3)
        job = {}
        for i, (k, v) in enumerate(unpack(lay.keys, out).items()):
            if v.count > 0 or np.isfinite(v.extreme):  # else no rank filled it this step
                job[k] = replace(v, rank=int(win[i])) if v.at is not None else v
        return self._tensor_parallel(job, vals) if self.tp is not None else job

    def _tensor_parallel(self, job: dict[SlotKey, SlotValues], vals: np.ndarray) -> dict[SlotKey, SlotValues]:
        """Under tensor parallelism a tp rank holds a contiguous block of each attention layer's heads: a split
        slot's per-head values are combined over the data ranks per tp coordinate, then laid side by side in tp
        order (its extreme, count and location are already the job's). Replicated modules (the residual, a router,
        a head with replicated logits) count every tp rank alike: their means are unchanged, their maxima too. A
        head whose logits are split over the vocabulary measures a logsumexp per shard, and the sum of shards'
        logsumexp² is not the whole vocabulary's: known when a data index's tp ranks disagree on it, and then
        taken from the step's first head call's per-position logsumexps instead (``_vocab_split``); left out when
        those are missing (a compiled head: ``precursors_vocab_split``, once)."""
        tp = int(self.tp.max()) + 1
        out = {}
        for k, v in job.items():
            at = self.agreed.offsets[k]
            cols = vals[:, at:at + k.size]  # (W, size)
            if k.stat == _PARTS:
                continue
            if k.stat == _LSE and any(len(np.unique(cols[self.data == d, 0])) > 1 for d in np.unique(self.data)):
                whole = self._vocab_split(k, vals)
                if whole is not None:
                    out[k] = replace(v, value=np.array([whole[0]]), count=whole[1])
                elif not self._said_vocab:
                    self._said_vocab = True
                    self.counters["precursors_vocab_split"] += 1
                    log.info("gradloc: precursors: the head's logits are split over the vocabulary (tensor "
                             "parallel) and its per-position logsumexps are missing: its logsumexp² is not "
                             "measured, its largest |logit| is")
                continue
            if k.stat not in _SPLIT:
                out[k] = v
                continue
            per = [cols[self.tp == c].max(0) if k.reduce is Reduce.MAX else cols[self.tp == c].sum(0)
                   for c in range(tp)]  # tp × (size,)
            if k.stat == "attn_entropy":  # [sums (H) | rows (H)] per coordinate -> [sums (tp·H) | rows (tp·H)]
                h = k.size // 2
                value = np.concatenate([p[:h] for p in per] + [p[h:] for p in per])
            else:
                value = np.concatenate(per)
            out[replace(k, size=k.size * tp)] = replace(v, value=value)
        return out

    def _vocab_split(self, lse: SlotKey, vals: np.ndarray) -> tuple[float, float] | None:
        """Σ logsumexp² over the whole vocabulary and how many positions: per data index, each sampled position's
        shard logsumexps (one per tp rank, the step's first head call's) combined by a logsumexp over the shards,
        then squared; None when a rank's are missing (not exactly one call each)."""
        parts = [k for k in self.agreed.keys if k.stat == _PARTS and k.layer == lse.layer]
        if len(parts) != 1:
            return None
        k = parts[0]
        at = self.agreed.offsets[k]
        each, calls = vals[:, at:at + k.size], vals[:, at + k.size]  # (W, P), (W,)
        if not (calls == 1).all():
            return None
        total, n = 0.0, 0
        for d in np.unique(self.data):
            whole = np.logaddexp.reduce(each[self.data == d], axis=0)  # (tp, P) -> (P,); −inf: not a loss position
            kept = np.isfinite(whole)
            total += float(np.square(whole[kept]).sum())
            n += int(kept.sum())
        return (total, float(n)) if n else None


def job_slots(comm: Any, layout: Any, counters: Counter[str]) -> JobSlots | None:
    """A multi-rank job's (``comm``: its world) precursor agreement, with each rank's tp coordinate and data index
    from ``layout`` (parallel/layout.py; none: data parallelism alone)."""
    if comm is None:
        return None
    every = getattr(layout, "every", ()) if layout is not None and layout.size("tp") > 1 else ()
    if every:
        return JobSlots(counters, [c.get("tp", 0) for c in every], [c["dp"] for c in every])
    return JobSlots(counters)


__all__ = ["DESCRIPTOR", "JobSlots", "describe", "job_slots"]
