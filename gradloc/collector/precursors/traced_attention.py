"""Attention inside torch.compile graphs (:class:`TracedAttention`), measured into compiled.py's accumulators: a
compiled model never runs the eager forward the hooks find attention from (hooks.py watches SDPA and softmax calls
there), so its **sites** are found by structure — the modules whose own ``forward`` refers to scaled-dot-product
attention or to HF's attention dispatch, or to a softmax in a module with a head count (structure.attention_sites:
the names its code uses, the same innermost module the eager discovery names) — and the attention functions they
call are replaced, while the hooks are attached, by wrappers that dynamo traces into the graph:

- ``F.scaled_dot_product_attention`` (SDPA, and HF's ``sdpa`` attention, which calls it);
- HF's ``eager_attention_forward`` — the function a site's modeling module defines and calls for
  ``attn_implementation="eager"``, looked up there as a module global at each call — in the modeling modules of
  the sites whose forward names it and whose config says ``eager``. It computes its softmax itself, so its logits
  are taken from its arguments (query, key, the additive mask, ``scaling``), as SDPA's are — for HF's standard
  recipe (:func:`standard_eager`); a site calling another (a softcap, sinks, a position bias) is a softmax site;
- ``F.softmax`` and ``torch.softmax`` at the **softmax sites** — a hand-written attention (nanoGPT's
  ``F.softmax(q·kᵀ·scale masked, dim=-1)``) and HF's non-standard eager ones (``nn.functional.softmax``): a
  last-dim softmax over a 4-D tensor there is measured from its input, every row, as the eager path's mode measures
  it (its logits exist: no T×T is built for the statistics); any other softmax (a router's) is not attention and
  passes. Dynamo knows both functions by name in a map it builds once, on first use (trace_rules): it is built
  before they are swapped (:func:`_known_to_dynamo`), or dynamo would take the wrapper for the function and put it
  in the graph untraced. Not measured under compile: the method ``x.softmax(...)`` (dynamo traces a method of an
  intermediate tensor as the op itself, whatever ``torch.Tensor`` holds: a site whose forward calls it so, by its
  bytecode — structure.softmax_as_method — is said, not measured) and a softmax bound before ``watch``.
  These wrappers work inside activation-checkpointed regions (a torch-function mode entered there would not:
  dynamo refuses the mode-stack change inside the checkpoint's higher-order op).

A site's pre-hook, traced, names the site and its post-hook clears it (a Python attribute dynamo tracks; set and
undone inside the site, which is what an activation-checkpointed region allows); the wrapper measures the call as
the eager path does (measure.attention_logits on the sampled query rows) and folds it into the site's
accumulators, gated on the device by ``attend`` (the step's attention micro-batches). Nothing else in the traced
code changes Python state. The accumulators are sized by the site's head count, read from the module
(``num_heads``, ``n_heads``, its config's ``num_attention_heads``…: structure.site_heads) when the hooks are
installed; a call with another count (a head-sharded attention) folds into the site's ``attn_unmatched`` count,
read on the host as ``precursors_unsupported``; a site whose count is found nowhere is not measured (said once).
The statistics are computed on every call there (the gate masks their fold; a compiled graph does not branch on a
Python value), fused by the compiler. Called eagerly (a model that is not compiled), a wrapper passes through: the
eager path measures that call. An attention whose forward calls its softmax from a helper of its own (a method) is
not found by structure, and not measured under compile.
"""
from __future__ import annotations

import inspect
import sys
from collections import Counter
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from gradloc.collector.precursors import measure
from gradloc.collector.precursors.compiled import Folds
from gradloc.collector.precursors.intercept import softmax_input
from gradloc.collector.precursors.module_stats import attention_keys
from gradloc.collector.precursors.slots import Reduce, SlotKey
from gradloc.collector.precursors.structure import calls_attention, forward_names, site_heads, softmax_as_method

EAGER = "eager_attention_forward"  # HF's eager attention function, defined in each modeling module


def unmatched_key(site: str) -> SlotKey:
    """Calls at a compiled site whose query heads are not the count its accumulators were sized by."""
    return SlotKey("attn_unmatched", site, Reduce.SUM, 1)


def _sdpa_call(args: tuple, kwargs: dict) -> tuple:
    """SDPA's (query, key, attn_mask, is_causal, scale)."""
    q, k = args[0], args[1]
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
    return q, k, mask, bool(causal), args[6] if len(args) > 6 else kwargs.get("scale")


_SIGNATURE = ("module", "query", "key", "value", "attention_mask", "scaling", "dropout")
_RECIPE = frozenset({"contiguous", "dropout", "dtype", "float32", "functional", "matmul", "nn", "num_key_value_groups",
                     "repeat_kv", "size", "softmax", "to", "torch", "training", "transpose"})


def standard_eager(fn: Callable) -> bool:
    """Whether a modeling module's ``eager_attention_forward`` is HF's standard recipe — softmax(q·kᵀ·scaling +
    mask) with grouped-query heads repeated, ``scaling`` None meaning 1/√d — by its signature and the names its code
    uses (nothing beyond the recipe's: no ``tanh`` softcap, no sinks, no position bias). 313 of transformers
    5.24's 356 are (LLaMA, Qwen, Mistral, BERT and their kin; not Gemma, GPT-2, GPT-OSS, T5); the rest are not
    measured under compile."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return code is not None and code.co_varnames[: len(_SIGNATURE)] == _SIGNATURE and \
        code.co_argcount == len(_SIGNATURE) and set(code.co_names) <= _RECIPE


def _eager_call(args: tuple, kwargs: dict) -> tuple:
    """A standard ``eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kw)``:
    its (query, key, additive mask cut to the keys, no causal flag, scaling)."""
    q = args[1] if len(args) > 1 else kwargs.get("query")
    k = args[2] if len(args) > 2 else kwargs.get("key")
    mask = args[4] if len(args) > 4 else kwargs.get("attention_mask")
    if mask is not None and k is not None:
        mask = mask[..., : k.shape[-2]]  # (B, 1, T, S') -> (B, 1, T, S), as HF's eager attention cuts it
        mask = mask.float() if mask.dtype == torch.bool else mask  # added, as that function adds it
    return q, k, mask, False, args[5] if len(args) > 5 else kwargs.get("scaling")


def _known_to_dynamo() -> bool:
    """Have dynamo map the torch functions it calls into graphs by name (``torch.softmax``,
    ``torch.nn.functional.softmax``…) before the softmax wrappers take those names: that map is built once, on
    first use, from the names; built with a wrapper in place, dynamo would take the wrapper for the function (and
    put it in the graph, not trace it) and the function, reached through it, for an unknown builtin. Called by
    ``prepare``, before any swap (built once: cached by dynamo). False: this torch has no such map to build (its
    private API moved): the site is not measured under compile (said, with why)."""
    try:
        from torch._dynamo import trace_rules

        trace_rules.get_torch_obj_rule_map()
        return True
    except Exception:
        return False


class TracedAttention:
    """Attention calls inside compiled graphs, measured into :class:`Folds` (the module docstring says how)."""

    def __init__(self, folds: Folds, queries: int, counters: Counter[str]) -> None:
        self.folds, self.queries, self.counters = folds, queries, counters
        self.site: str | None = None  # the site whose forward is being traced (set by its traced pre-hook)
        self.heads: dict[str, int] = {}  # site -> its query heads (the accumulators' size)
        self.softmax_sites: set[str] = set()  # sites measured at their softmax (the module docstring)
        self._targets: dict[tuple[int, str], tuple[Any, str, Callable]] = {
            (id(F), "scaled_dot_product_attention"): (F, "scaled_dot_product_attention", _sdpa_call)}
        self._wrappers: dict[tuple[int, str], Callable] = {}  # made once: a reference bound to one keeps working
        self._saved: dict[tuple[int, str], Callable] = {}  # kept after remove, for those references
        self._installed: set[tuple[int, str]] = set()

    def prepare(self, sites: dict[str, nn.Module]) -> list[tuple[str, str]]:
        """Eagerly, when the hooks are installed: the sites' accumulators and the modeling modules whose
        ``eager_attention_forward`` they call; the sites not measured, each with why."""
        skipped = []
        for site, module in sites.items():
            heads = site_heads(module)
            if heads is None:
                skipped.append((site, "has its head count in none of its attributes"))
                continue
            home = sys.modules.get(type(module).__module__)
            eager = getattr(home, EAGER, None) if EAGER in forward_names(module) else None
            eager_config = getattr(getattr(module, "config", None), "_attn_implementation", "") == "eager"
            if callable(eager) and eager_config and standard_eager(eager):
                self._targets.setdefault((id(home), EAGER), (home, EAGER, _eager_call))
            elif not calls_attention(module) and softmax_as_method(module):
                skipped.append((site, "calls softmax as a tensor method (dynamo traces it as the op itself)"))
                continue
            elif (callable(eager) and eager_config) or not calls_attention(module):  # it computes its softmax
                if not _known_to_dynamo():
                    skipped.append((site, "computes its softmax itself and this torch's dynamo has no function map "
                                          "to build before swapping it"))
                    continue
                self.softmax_sites.add(site)
                for holder in (F, torch):
                    self._targets.setdefault((id(holder), "softmax"), (holder, "softmax", softmax_input))
            self.heads[site] = heads
            for key in (*attention_keys(site, heads), unmatched_key(site)):
                self.folds.prepare(key)
        return skipped

    def install(self) -> None:
        """Swap the wrappers in (again after ``remove``: a monitor detached and attached)."""
        for key, (holder, attr, parse) in self._targets.items():
            if key not in self._installed:
                self._saved[key] = getattr(holder, attr)
                wrapper = self._wrappers.setdefault(key, self._wrapper(key, parse))
                wrapper.__wrapped__ = self._saved[key]  # another monitor's prepare reads the function it wraps
                setattr(holder, attr, wrapper)
                self._installed.add(key)

    def remove(self) -> None:
        """Swap the functions back; one swapped again on top of ours keeps ours in its chain, passing through."""
        for key in list(self._installed):
            holder, attr, _ = self._targets[key]
            if getattr(holder, attr) is self._wrappers[key]:
                setattr(holder, attr, self._saved[key])
                self._installed.discard(key)
        self.site = None

    def _wrapper(self, key: tuple[int, str], parse: Callable) -> Callable:
        softmax = parse is softmax_input  # (a trace-time constant, as everything the branches below read)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = self._saved[key](*args, **kwargs)
            if not torch.compiler.is_dynamo_compiling():  # eager, or AOT tracing a graph dynamo made
                return out
            site = self.site
            if site is not None and (site in self.softmax_sites) is softmax:
                call = parse(args, kwargs)
                if call is not None:
                    self.site = None  # the statistics' own softmax is not the site's (set back: no state changed)
                    self._fold(site, call)
                    self.site = site
            return out
        return wrapper

    def _stats(self, call: tuple | torch.Tensor, heads: int) -> dict[str, torch.Tensor] | None:
        """The statistics of one call: an SDPA-like call's (query, key, mask, causal, scale) at the sampled query
        rows, a softmax's input (B, H, T, S) every row; None when its heads are not ``heads``."""
        if isinstance(call, torch.Tensor):
            return measure.attention_stats(call.detach()) if call.shape[1] == heads else None
        q, k, mask, causal, scale = call
        if q is None or k is None or q.dim() != 4 or k.dim() != 4 or q.shape[1] != heads or heads % k.shape[1]:
            return None
        rows = measure.query_rows(q.shape[2], self.queries, q.device)
        return measure.sampled_attention_stats(q, k, rows, mask, causal, scale)

    def _fold(self, site: str, call: tuple | torch.Tensor) -> None:
        """Traced: one attention call of ``site`` into its accumulators (no Python state changed)."""
        heads = self.heads.get(site)
        if heads is None:
            return
        top, ent = attention_keys(site, heads)
        with torch.no_grad():
            s = self._stats(call, heads)
            if s is None:  # counted
                self.folds.fold(unmatched_key(site), torch.zeros(1, device=self.folds.device), attention=True)
                return
            self.folds.fold(top, s["max"], extreme=s["max"].amax(), at=s["max_at"], attention=True)
            self.folds.fold(ent, torch.cat([s["entropy_sum"], s["rows"]]), extreme=s["min_row"], at=s["min_at"],
                            attention=True)


__all__ = ["EAGER", "TracedAttention", "standard_eager", "unmatched_key"]
