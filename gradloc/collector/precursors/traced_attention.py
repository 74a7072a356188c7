"""Attention inside torch.compile graphs (:class:`TracedSdpa`), measured into compiled.py's accumulators: a compiled
model never runs the eager forward the hooks find attention from (hooks.py watches SDPA and softmax calls there), so
its **sites** are found by structure — the modules whose own ``forward`` refers to scaled-dot-product attention or
to HF's attention dispatch (structure.attention_sites: the names its code uses, the same innermost module the eager
discovery names) — and ``F.scaled_dot_product_attention`` is replaced, while the hooks are attached, by a wrapper
that dynamo traces into the graph: a site's pre-hook, traced, names the site and its post-hook clears it (a Python
attribute dynamo tracks; set and undone inside the site, which is what an activation-checkpointed region allows),
the wrapper measures the call as the eager path does (measure.attention_logits on the sampled query rows) and folds
it into the site's accumulators, gated on the device by ``attend`` (the step's attention micro-batches). Nothing
else in the traced code changes Python state. The accumulators are sized by the site's head count, read from the
module (``num_heads``, ``n_heads``, its config's ``num_attention_heads``…: structure.site_heads) when the hooks are
installed; a call with another count (a head-sharded attention) folds into the site's ``attn_unmatched`` count, read
on the host as ``precursors_unsupported``; a site whose count is found nowhere is not measured (said once). The
statistics are computed on every call there (the gate masks their fold; a compiled graph does not branch on a Python
value), fused by the compiler. An attention that computes its softmax itself (HF's eager attention) is not measured
under compile.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from gradloc.collector.precursors import measure
from gradloc.collector.precursors.compiled import Folds
from gradloc.collector.precursors.module_stats import attention_keys
from gradloc.collector.precursors.slots import Reduce, SlotKey
from gradloc.collector.precursors.structure import site_heads


def unmatched_key(site: str) -> SlotKey:
    """Calls at a compiled site whose query heads are not the count its accumulators were sized by."""
    return SlotKey("attn_unmatched", site, Reduce.SUM, 1)


class TracedSdpa:
    """SDPA calls inside compiled graphs, measured into :class:`Folds` (the module docstring says how)."""

    def __init__(self, folds: Folds, queries: int, counters: Counter[str]) -> None:
        self.folds, self.queries, self.counters = folds, queries, counters
        self.site: str | None = None  # the site whose forward is being traced (set by its traced pre-hook)
        self.heads: dict[str, int] = {}  # site -> its query heads (the accumulators' size)
        self._saved: Callable[..., Any] | None = None  # kept after remove: a reference bound to the wrapper still works
        self._installed = False

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = self._saved(*args, **kwargs)
            if torch.compiler.is_compiling() and self.site is not None:
                self._fold(self.site, args, kwargs)
            return out
        self._wrapper = wrapper

    def prepare(self, sites: dict[str, nn.Module]) -> list[str]:
        """Eagerly, when the hooks are installed: the sites' accumulators; the sites whose head count is found
        nowhere (not measured under compile)."""
        missing = []
        for site, module in sites.items():
            heads = site_heads(module)
            if heads is None:
                missing.append(site)
                continue
            self.heads[site] = heads
            for key in (*attention_keys(site, heads), unmatched_key(site)):
                self.folds.prepare(key)
        return missing

    def install(self) -> None:
        """Swap the wrapper in (again after ``remove``: a monitor detached and attached)."""
        if not self._installed:
            self._saved, F.scaled_dot_product_attention = F.scaled_dot_product_attention, self._wrapper
            self._installed = True

    def remove(self) -> None:
        """Swap the function back; swapped again on top of ours, ours stays in that chain, passing through."""
        if self._installed and F.scaled_dot_product_attention is self._wrapper:
            F.scaled_dot_product_attention = self._saved
            self._installed = False
        self.site = None

    def _fold(self, site: str, args: tuple, kwargs: dict) -> None:
        """Traced: one SDPA call of ``site`` into its accumulators (no Python state changed)."""
        heads = self.heads.get(site)
        if heads is None:
            return
        q, k = args[0], args[1]
        if q.dim() != 4 or k.dim() != 4 or q.shape[1] != heads or heads % k.shape[1]:
            self.folds.fold(unmatched_key(site), q.new_zeros(1), attention=True)  # counted, on the host
            return
        top, ent = attention_keys(site, heads)
        with torch.no_grad():
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
            scale = args[6] if len(args) > 6 else kwargs.get("scale")
            rows = measure.query_rows(q.shape[2], self.queries, q.device)
            s = measure.attention_stats(measure.attention_logits(q, k, rows, mask, bool(causal), scale), rows)
            self.folds.fold(top, s["max"], extreme=s["max"].amax(), at=s["max_at"], attention=True)
            self.folds.fold(ent, torch.cat([s["entropy_sum"], s["rows"]]), extreme=s["min_row"], at=s["min_at"],
                            attention=True)


__all__ = ["TracedSdpa", "unmatched_key"]
