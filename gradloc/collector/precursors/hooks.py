"""Where the precursor statistics are taken: hooks on the modules that hold them, found on the first micro-batch.

Discovery (the first micro-batch with a forward): a forward pre- and post-hook on every module keeps the stack of
modules running, and a ``TorchFunctionMode`` active for that block sees every call of scaled-dot-product attention
(``F.scaled_dot_product_attention``, which HF's sdpa and flash paths and most hand-written models call) and of a
last-dim softmax over a 4-D tensor (an eager attention's weights). The innermost module running at such a call is
an **attention site**; the last module with parameters of its own to run in the forward is the **loss head**, and
the one before it, when its class is a norm, the **final norm**; MoE routers are known by type
(collector/rules/router.py). Then the discovery hooks go, and from the next micro-batch on only these stay:

- an attention site that called SDPA gets the function swapped for a thin wrapper during its own forward
  (intercept.SdpaSwap: nothing else it calls pays anything); one that computes its softmax itself runs under the
  mode between its pre- and post-hook, in the first ``attention_micro_batches`` micro-batches of a step (one by
  default: the cost does not grow with gradient accumulation). An SDPA call is measured on ``attention_queries``
  query rows per sequence (measure.attention_logits: its T×T is never built), an eager softmax on its own weights,
  every row;
- the head's forward hook measures its output logits, the final norm's pre-hook its input, a router's forward hook
  its logits and choices.

Discovery's mode is not entered for a model handed over compiled (a ``torch.compile`` wrapper) or with a module
compiled in place (``module.compile()``): an active mode is part of dynamo's guards, its graphs would be traced
again with it, and again without it. A model compiled after ``watch`` and first called inside the first block is
traced once with the mode (one extra compilation, once). Nothing runs outside a micro-batch block, with gradients
off (a probe, evaluation) or in a re-run forward (activation checkpointing).

Inside a compiled graph attention, the head, the final norm and the routers are measured into persistent
accumulators (compiled.py: ``Folds``; traced_attention.py); a model handed over compiled has its head and final
norm found by structure (``_discover_by_structure``), and a compiled model its attention sites
(``_sites_by_structure``: the modules whose forward calls SDPA by name); counted once in ``precursors_compiled``,
also when no module ran eagerly in the first block of a model compiled some other way. A call whose shapes are not
understood is counted (``precursors_unsupported``), never guessed; no exception leaves a hook.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gradloc.collector.precursors.intercept import SDPA, AttentionMode, SdpaSwap, Unsupported, attention_call
from gradloc.collector.precursors.compiled import Folds
from gradloc.collector.precursors.module_stats import ModuleStats, attention_keys, router_key
from gradloc.collector.precursors.slots import SlotKey, StepSlots
from gradloc.collector.precursors.structure import (attention_sites, calls_attention, compiled_in_place,
                                                   compiles_inside, complete_order, head_and_norm, inside,
                                                   registered_order)
from gradloc.collector.precursors.traced_attention import TracedAttention
from gradloc.collector.rules.router import is_router
from gradloc.config import PrecursorConfig

log = logging.getLogger("gradloc")
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


class PrecursorHooks(ModuleStats):
    def __init__(self, model: nn.Module, cfg: PrecursorConfig, counters: Counter[str], compiled: bool = False,
                 tp: tuple[int, int] = (0, 1)) -> None:
        """``compiled``: the model was handed over compiled (a torch.compile wrapper): no discovery mode.
        ``tp``: this rank's (coordinate, size) along tensor parallelism; over 1, the head's per-position
        logsumexps are kept too (a vocabulary shard's: job.py), and a final norm of a sequence-parallel region
        places its positions at this rank's block of the sequence."""
        self.model, self.cfg, self.counters, self.compiled = model, cfg, counters, compiled
        self.tp_rank, self.tensor_parallel = tp[0], tp[1] > 1
        self.parts_taken = False  # the head's per-position logsumexps were kept this step (module_stats.py)
        self.slots = StepSlots()
        self.names = {m: n for n, m in model.named_modules()}
        self.routers = [n for n, m in model.named_modules() if is_router(m)] if cfg.router else []
        self.sites: list[str] = []  # attention modules (discovered)
        self.head: str | None = None
        self.final_norm: str | None = None
        self.discovered = False
        self._stack: list[str] = []  # modules running (discovery), or attention sites running (after it)
        self._order: list[str] = []  # modules with parameters of their own, in forward order (discovery)
        self._handles: list[Any] = []
        self._mode: AttentionMode | None = None
        self._swap = SdpaSwap(self.on_attention)
        self._swapped: set[str] = set()  # sites that call SDPA: measured through the swap (intercept.py)
        self._entered = 0
        self.micro_batch: int | None = None
        self.keep: torch.Tensor | None = None
        self.attention_on = cfg.attention
        self._steps = 0
        self._said_none = False
        compiles = compiled or compiles_inside(model)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.folds = Folds(device) if compiles else None  # what compiled graphs measure (compiled.py)
        self.traced = TracedAttention(self.folds, cfg.attention_queries, counters) \
            if compiles and cfg.attention else None

    # -- lifecycle ---------------------------------------------------------------------------
    def attach(self) -> None:
        if self.compiled and not self.discovered:  # a compiled model runs no module eagerly: found by structure
            self._discover_by_structure()
        if not self.discovered:
            modules = dict(self.model.named_modules())
            for name in self.routers:
                self._handles.append(modules[name].register_forward_hook(self._router_hook(name)))
            for name, module in modules.items():
                self._handles.append(module.register_forward_pre_hook(self._push(name)))
                self._handles.append(module.register_forward_hook(self._pop(name)))
        else:
            self._install()

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._leave_all()
        if self.traced is not None:
            self.traced.remove()

    def begin(self, micro_batch: int, keep: torch.Tensor | None) -> None:
        """A micro-batch block opens (``keep``: its loss positions, (B, T) bool, or None)."""
        self.micro_batch, self.keep = micro_batch, keep
        self._stack.clear()
        if self.folds is not None:
            self.folds.begin(micro_batch, attend=self._attends())
        if not self.discovered and self.attention_on and not self.compiled and not compiles_inside(self.model):
            self._enter()  # a mode on the stack is part of dynamo's guards: a compiled model's graphs would retrace

    def end(self) -> None:
        """The block closed (its backward ran, or it failed)."""
        self._leave_all()
        self.micro_batch, self.keep = None, None
        if self.folds is not None:
            self.folds.end()
        if not self.discovered and self._order:
            self._finish_discovery()
        elif not self.discovered and not self._said_none:  # no module ran eagerly in the block: a compiled forward
            self._said_none = True
            self.counters["precursors_compiled"] += 1
            log.info("gradloc: precursors: no module ran eagerly in the first micro-batch (a compiled model?): "
                     "nothing is measured until one does")

    def take(self) -> tuple[tuple[SlotKey, ...], torch.Tensor | None]:
        """The step's slots (collector/precursors/slots.py); the next step starts empty."""
        self._steps += 1
        self.parts_taken = False
        self.attention_on = self.cfg.attention and self._steps % self.cfg.attention_every == 0
        keys, pack = self.slots.take()
        if self.folds is None:
            return keys, pack
        fkeys, fpack = self.folds.take()  # what the compiled graphs folded (unfilled ones: left out on the host)
        if fpack is None:
            return keys, pack
        return keys + fkeys, fpack if pack is None else torch.cat([pack, fpack])

    def _discover_by_structure(self) -> None:
        """The head, the final norm and the attention sites of a model handed over compiled (structure.py)."""
        self.head, self.final_norm = head_and_norm(self.model, registered_order(self.model))
        self.discovered = True
        self._sites_by_structure()
        self.counters["precursors_compiled"] += 1
        log.info("gradloc: precursors: a compiled model: loss head %s, final norm %s, %d router(s), attention in %s "
                 "measured inside its graphs", self.head, self.final_norm or "none found", len(self.routers),
                 ", ".join(self.sites) or "no module (none calls attention or a softmax by name)")

    def _sites_by_structure(self) -> None:
        """A compiled model's attention sites: by the names their forward uses (structure.attention_sites); an eager
        call at one calling attention by name goes through the SDPA swap (HF's eager falls back to the mode), at
        one calling a softmax through the mode."""
        if self.traced is not None:
            modules = dict(self.model.named_modules())
            self.sites = attention_sites(self.model)
            self._swapped.update(s for s in self.sites if calls_attention(modules[s]))

    # -- discovery ----------------------------------------------------------------------------
    def _measuring(self) -> bool:
        if torch.compiler.is_compiling():  # first: a traced hook folds to nothing (no graph break, no side effect)
            return False
        return self.micro_batch is not None and torch.is_grad_enabled() and _graph_task_id() == -1

    def _live(self) -> bool:
        """Whether a head, norm or router call is measured: eagerly inside a block (``_measuring``); traced into a
        compiled graph with gradients on, into the accumulators (gated on the device by an open block)."""
        if torch.compiler.is_compiling():
            return self.folds is not None and torch.is_grad_enabled()
        return self._measuring()

    def _push(self, name: str):
        def pre(module: nn.Module, args: tuple) -> None:
            if self._measuring():
                self._stack.append(name)
                if any(p.requires_grad for p in module.parameters(recurse=False)):
                    self._order.append(name)
        return pre

    def _pop(self, name: str):
        def post(module: nn.Module, args: tuple, out: Any) -> None:  # the head is not known yet: not measured
            if torch.compiler.is_compiling():  # first, as in every hook here: traced, it is nothing (no guard on name)
                return
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
        return post

    def _finish_discovery(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.discovered = True
        self.head, self.final_norm = head_and_norm(self.model, complete_order(self.model, self._order))
        self._order = []
        if not self.sites:  # a module compiled in place ran no attention under the discovery mode
            self._sites_by_structure()
        self._install()
        log.info("gradloc: precursors: attention in %s, loss head %s, final norm %s, %d router(s)",
                 ", ".join(self.sites) or "no module (none called SDPA or a softmax over attention weights)",
                 self.head, self.final_norm or "none found", len(self.routers))

    def _install(self) -> None:
        modules = dict(self.model.named_modules())
        for name in self.routers:
            self._handles.append(modules[name].register_forward_hook(self._router_hook(name)))
            if self.folds is not None:
                self.folds.prepare(router_key(name, modules[name].weight.shape[0]))  # is_router: weight (E, d)
        if self.traced is not None and self.sites:  # attention inside compiled graphs (traced_attention.py)
            regions = [""] if self.compiled else compiled_in_place(self.model)
            for site, why in self.traced.prepare({name: modules[name] for name in self.sites}):
                if inside(site, regions):  # one that runs eagerly is measured there (the SDPA swap, the mode)
                    self.counters["precursors_unsupported"] += 1
                    log.info("gradloc: precursors: %s %s: its attention is not measured inside a compiled graph",
                             site, why)
            self.traced.install()
        for name in self.sites:
            self._handles.append(modules[name].register_forward_pre_hook(self._site_in(name)))
            self._handles.append(modules[name].register_forward_hook(self._site_out(name)))
        self._hook_head_and_norm(modules)

    # -- the mode -----------------------------------------------------------------------------
    def _enter(self) -> None:
        if self._mode is None:
            self._mode = AttentionMode(self.on_attention)
        self._mode.__enter__()
        self._entered += 1

    def _leave_all(self) -> None:
        while self._swap.depth:
            self._swap.leave()
        while self._entered:
            self._leave()

    def _leave(self) -> None:
        """Leave the mode once (it was entered: ``_entered`` > 0)."""
        self._entered -= 1
        try:
            self._mode.__exit__(None, None, None)
        except Exception:  # another mode entered inside ours and left open: never raise into training
            self.counters["precursors_mode_errors"] += 1
            log.debug("gradloc: leaving the precursor mode failed", exc_info=True)

    def _attends(self) -> bool:
        """Attention is measured in this block: an attention step, one of its first ``attention_micro_batches``."""
        n = self.cfg.attention_micro_batches
        return self.attention_on and (n == 0 or (self.micro_batch is not None and self.micro_batch < n))

    def _site_in(self, name: str):
        def pre(module: nn.Module, args: tuple) -> None:
            if torch.compiler.is_compiling():  # traced: name the site for the SDPA wrapper (gated on the device)
                if self.traced is not None and torch.is_grad_enabled():
                    self.traced.site = name
                return
            if self._attends() and self._measuring():
                self._stack.append(name)
                if name in self._swapped:
                    self._swap.hit = False
                    self._swap.enter()
                else:
                    self._enter()
        return pre

    def _site_out(self, name: str):
        def post(module: nn.Module, args: tuple, out: Any) -> None:
            if torch.compiler.is_compiling():
                if self.traced is not None:
                    self.traced.site = None
                return
            if not self._stack or self._stack[-1] != name:
                return
            self._stack.pop()
            if name in self._swapped and self._swap.depth:
                self._swap.leave()
                if not self._swap.hit:  # the model bound SDPA before the swap: this site goes back to the mode
                    self._swapped.discard(name)
                    self.counters["precursors_swap_missed"] += 1
            elif self._entered:
                self._leave()
        return post

    # -- measurements -------------------------------------------------------------------------
    def on_attention(self, func: Any, args: tuple, kwargs: dict) -> None:
        if not self._stack or not self._measuring():
            return
        site = self._stack[-1]
        try:
            with torch.no_grad():
                stats = attention_call(func, args, kwargs, self.cfg.attention_queries)
                if stats is None:
                    return  # a softmax that is not over attention weights (a router's, a head's)
                self._fold_attention(site, stats)
        except Unsupported:
            self.counters["precursors_unsupported"] += 1
        except Exception:
            self.counters["precursors_errors"] += 1
            log.debug("gradloc: attention precursors failed in %s", site, exc_info=True)
        if not self.discovered and site not in self.sites:
            self.sites.append(site)
            if func is SDPA:
                self._swapped.add(site)  # from the next micro-batch on: the swap, not the mode

    def _fold_attention(self, site: str, s: dict[str, torch.Tensor]) -> None:
        top, ent = attention_keys(site, s["max"].numel())
        self._record(top, s["max"], extreme=s["max"].amax(), at=s["max_at"], attention=True)
        self._record(ent, torch.cat([s["entropy_sum"], s["rows"]]), extreme=s["min_row"], at=s["min_at"],
                     attention=True)


def make_precursors(model: nn.Module, cfg: PrecursorConfig, counters: Counter[str], holds_head: bool = True,
                    compiled: bool = False, on_spike: bool = False,
                    tp: tuple[int, int] = (0, 1)) -> PrecursorHooks | None:
    """The monitor's precursor hooks (None: off). Under tensor parallelism a rank measures its block of the heads
    and its shard of the logits: the job's values combine them (collector/precursors/job.py). A pipeline stage
    without the loss head (``holds_head``) measures its attention only: its last module is not a head.
    ``token_stats="on_spike"`` (``on_spike``) promises no module hook on a healthy step: no precursors there."""
    if not cfg.enabled:
        return None
    if on_spike:
        log.info("gradloc: token_stats='on_spike' runs no module hook on a healthy step: precursor statistics are off")
        return None
    if not holds_head:
        cfg = replace(cfg, head_logits=False, residual=False)
    return PrecursorHooks(model, cfg, counters, compiled, tp)


__all__ = ["PrecursorHooks", "make_precursors"]
