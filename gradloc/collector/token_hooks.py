"""Forward hooks + output tensor hooks that accumulate per-position scores on the device.

For every module with a rule, each forward call inside a micro-batch block captures a small state
and attaches a hook to the output; in backward that hook adds the rule's score (shape B×T) to row
``layer`` of the micro-batch buffer ``(n_layers, B, T)``. No host sync, no exception ever leaves a
hook: failures and shape mismatches are counted in the buffer instead.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from gradloc.collector import compiled
from gradloc.collector.fit import fit_call, score
from gradloc.collector.head_read import read_head
from gradloc.collector.rules import rule_for
from gradloc.collector.rules.megatron import sequence_first_view
from gradloc.collector.rules.registry import reusing_sq_norm, sq_norm_last
from gradloc.collector.scores_buffer import MicroBatchScores
from gradloc.collector.shards import InnerSite, TPContext, is_dtensor, local, redistributes_inside
from gradloc.collector.watched import WatchedModule

log = logging.getLogger("gradloc")
# Id of the backward the calling thread is executing, -1 outside backward (torch >= 2.1).
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)




class TokenHooks:
    def __init__(self, model: nn.Module, layer_of: dict[str, str]) -> None:
        """``layer_of`` maps a module name to its layer group (the per-layer stats' grouping)."""
        self.layers: list[str] = []
        self.watched: list[WatchedModule] = []
        self.label_shifts = 0  # the head's neighbour offsets read per micro-batch with labels (collector/head_read.py)
        self.unruled: set[str] = set()  # classes with trainable parameters of their own and no rule
        by_name = dict(model.named_modules())
        for name, module in by_name.items():
            trains = any(p.requires_grad for p in module.parameters(recurse=False))
            caller = by_name.get(name.rsplit(".", 1)[0] if "." in name else "")
            rule = sequence_first_view(rule_for(module), caller if name else None)
            site = module
            if rule is not None and hasattr(rule, "site"):  # hooked on the caller that holds its routing
                site = rule.site(module, by_name.get(name.rsplit(".", 1)[0]) if "." in name else None)
                rule = rule if site is not None else None
            if rule is None and trains:
                self.unruled.add(type(module).__name__)
            if rule is None or not trains:
                continue
            group = layer_of.get(name, name or "<root>")
            if group not in self.layers:
                self.layers.append(group)
            self.watched.append(WatchedModule(name, module, rule, self.layers.index(group), site))
        self._handles: list[Any] = []
        self.tp: TPContext | None = None  # tensor parallelism (the TP backend sets it): hooks see DTensors
        self.routed: Any = None  # expert parallelism (the EP backend sets it): experts scored where they live
        self.pair_slots = 0  # Megatron sequence parallelism: linears whose factors the token group multiplies
        self.current: MicroBatchScores | None = None
        self._suspended = False
        self.taps = compiled.TapState()  # what hooks traced by torch.compile read (compiled.py)
        self._tap_fns = [compiled.make_tap(w.rule, w.module) for w in self.watched]
        self._devices = [next(w.module.parameters()).device for w in self.watched]
        holders = {n.rsplit(".", k)[0] for w in self.watched for n in [w.name] for k in range(1, n.count(".") + 1)}
        self._instances = max(Counter(type(by_name[n]) for n in holders).values(), default=1)  # e.g. the blocks

    def relayer(self, names: list[str], index: list[int]) -> None:
        """The job's token layers (every pipeline stage's): this rank's token layer i is ``names[index[i]]``."""
        self.layers = list(names)
        self.watched = [replace(w, layer=int(index[w.layer])) for w in self.watched]

    @property
    def suspended(self) -> bool:
        return self._suspended

    @suspended.setter
    def suspended(self, on: bool) -> None:
        self._suspended = on
        self.taps.active = self.current is not None and not on

    @property
    def covered_modules(self) -> set[str]:
        return {w.name for w in self.watched}

    def attach(self) -> None:
        compiled.guard_hooks(self._instances)  # no other compiled instance's graph runs for the watched model (compiled.py)
        if self.routed is not None:
            self.routed.install()
        for index, w in enumerate(self.watched):
            hook = self._make_hook(w, index)
            if self.tp is not None and redistributes_inside(w.site):  # torchtitan: between its redistributions
                self._handles.append(InnerSite(w.site, lambda args, out, hook=hook, w=w: hook(w.site, args, out)))
                continue
            if getattr(w.rule, "wants_kwargs", False):  # a module called with keywords (HF attention)
                call_args = w.rule.call_args

                def kw_hook(module: nn.Module, args: tuple, kwargs: dict, out: Any, hook=hook,  # noqa: ANN001
                            call_args=call_args) -> torch.Tensor | None:
                    return hook(module, call_args(args, kwargs), out)
                self._handles.append(w.site.register_forward_hook(kw_hook, with_kwargs=True, prepend=self.tp is not None))
            else:  # under TP: before the parallel styles' output hooks, to see the module's own DTensor output
                self._handles.append(w.site.register_forward_hook(hook, prepend=self.tp is not None))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.routed is not None:
            self.routed.remove()

    def begin(self, index: int, batch: int, seq: int, breakdown: bool = True,
              labels: torch.Tensor | None = None) -> None:
        self.current = MicroBatchScores(index, batch, seq, len(self.layers), breakdown, labels=labels,
                                        shifts=self.label_shifts if labels is not None else 0)
        t = self.taps
        t.batch, t.seq, t.last, t.reached = batch, seq, -1, False
        t.sinks = compiled.new_sinks(self._devices, batch, seq) if t.wanted else None
        t.active = not self._suspended
        self.current.sinks = t.sinks

    def end(self) -> MicroBatchScores | None:
        current, self.current = self.current, None
        t = self.taps
        if current is not None:
            current.sink_last = t.last
            if current.sinks is None and t.wanted and not current.forward_calls:  # traced before sinks existed
                current.lost_modules.update(self.covered_modules)  # nothing scored: unattributed, not zero
            elif current.sinks is not None and t.active and not t.reached and not current.forward_calls:
                current.untapped = True  # a graph without the taps ran (another instance's, a stale one)
                current.lost_modules.update(self.covered_modules)
        t.active, t.sinks = False, None
        return current

    def silent(self, buf: MicroBatchScores) -> bool:
        """No watched module's hook ran in the micro-batch, eagerly or traced (a graph compiled before
        the hooks were registered runs without them)."""
        return not (buf.forward_calls or buf.recompute_calls or buf.matched_calls or buf.dropped_calls
                    or buf.hook_errors or buf.sinks is not None or self.taps.wanted)

    def external(self, module: nn.Module) -> Callable[[torch.Tensor], None] | None:
        """Scores for a watched module whose weight a fused kernel uses without calling the module
        (TRL's fused LM head): call in forward, inside a micro-batch block; returns ``add(score)``
        for backward, ``score`` the module's (B, T) per-position score. None when nothing is
        captured (outside a block, paused, no grad, not watched). Until ``add`` runs, the module
        counts as called but unscored, so its gradient is reported as unattributed. An external
        score never becomes the position-exact layer (it may be an approximation). None too when
        the module did run in this micro-batch's forward: its own rule scores it."""
        buf = self.current
        w = next((w for w in self.watched if w.module is module), None)
        if buf is None or w is None or self.suspended or not torch.is_grad_enabled():
            return None
        if buf.forward_calls.get(w.name, 0) > buf.external_calls.get(w.name, 0):
            return None
        buf.external_calls[w.name] = buf.external_calls.get(w.name, 0) + 1
        buf.forward_calls[w.name] = buf.forward_calls.get(w.name, 0) + 1
        buf.matched_calls += 1
        buf.matched_modules.add(w.name)

        def add(score: torch.Tensor) -> None:
            try:
                with torch.no_grad():
                    buf.add(w.layer, score.float())
                buf.scored_modules.add(w.name)
            except Exception:  # never raise into the training loop
                buf.hook_errors += 1
                log.debug("gradloc: external score failed on %s", w.name, exc_info=True)

        return add

    def _make_hook(self, w: WatchedModule, index: int):
        fn = self._tap_fns[index]

        def hook(module: nn.Module, args: tuple, out: Any) -> torch.Tensor | None:
            if torch.compiler.is_compiling():  # traced into a graph: the tap (compiled.py), never self.current
                return compiled.tap(self.taps, index, w.rule, w.module, fn, args, out, module, w.site)
            if module is not w.site:  # a copy that inherited the hook (copy.deepcopy: an EMA model): not watched
                return None
            buf = self.current
            if buf is None or self.suspended or not torch.is_grad_enabled():
                return
            try:
                return _capture(w, buf, args, out, self.tp)
            except Exception as exc:  # never raise into the training loop
                buf.hook_errors += 1
                buf.first_error = buf.first_error or f"{w.name} (forward): {type(exc).__name__}: {exc}"
                buf.lost_modules.add(w.name)
                log.debug("gradloc: forward hook failed on %s", w.name, exc_info=True)

        return hook


def _capture(w: WatchedModule, buf: MicroBatchScores, args: tuple, out: Any,
             tp: TPContext | None = None) -> torch.Tensor | None:
    """Capture one call; returns the output to hand on in place of the module's (fit.py), or None."""
    whole = out
    out = w.rule.output(out) if hasattr(w.rule, "output") else out  # a router's logits, first of a tuple
    if not args or not isinstance(out, torch.Tensor) or not out.requires_grad:
        return None
    recompute = _graph_task_id() != -1  # a forward run by the autograd engine: activation checkpointing
    calls = buf.recompute_calls if recompute else buf.forward_calls
    calls[w.name] = n = calls.get(w.name, 0) + 1
    if recompute and n <= buf.forward_calls.get(w.name, 0):
        return None  # non-reentrant: the original forward's output receives the gradient, not this re-run
    if getattr(w.rule, "takes_over", False):  # rows, not positions: scored and routed elsewhere (parallel/ep.py)
        w.rule.capture_routed(w, buf, args, out)
        return None
    x, y, span, factor, columns = args[0], out, None, 1.0, 0
    head = buf.labels is not None  # the head's u_p may be read here: batch-first, its columns known
    if tp is not None:  # DTensor input/output: score this rank's shards (collector/shards.py)
        lead = len(w.rule.lead_shape(w.module, local(x), local(out)))
        view = tp.view(w.module, x, out, lead)
        x, y, span, factor, columns = view.x, view.out, view.span, view.factor, view.features
        # readable: a DTensor (its columns known), a rule that places its own (Megatron's [s, b, v/tp] shards), or a
        # plain output every tp rank holds whole (no split parameters: factor 1/tp, the torch rules' (B, T) lead)
        head = head and span is None and (is_dtensor(out) or hasattr(w.rule, "head_view") or factor != 1.0)
    B, T = buf.batch, buf.seq
    if span is not None:
        B, T = (B, span.length) if span.dim == 1 else (span.length, T)
    fit = fit_call(w.rule, w.module, x, y, B, T)
    if fit is None:  # not (B, T) positions
        buf.dropped_calls += 1
        buf.dropped_layers.add(w.layer)
        buf.lost_modules.add(w.name)
        return None
    x, y, extra = fit.x, fit.out, fit.extra
    with torch.no_grad():
        saved = w.rule.capture_call(w.module, args, y, whole) if hasattr(w.rule, "capture_call") else \
            buf.capture(w.rule, w.module, x, y)
    buf.matched_calls += 1
    buf.matched_modules.add(w.name)
    if not recompute:  # reentrant re-runs go in reverse block order: they never name the last layer
        buf.last_layer = w.layer
        buf.calls += 1
        buf.last_call = call = buf.calls
    else:
        call = 0

    def on_grad(g: torch.Tensor) -> None:
        try:
            with torch.no_grad():
                g = local(g)
                if head and call and call == buf.last_call:
                    hg, first, share = w.rule.head_view(w.module, g) if hasattr(w.rule, "head_view") else \
                        (g, columns, factor)
                    g2 = sq_norm_last(hg)  # (*lead, V) -> lead: one reduction for the surprise and the rule's score
                    read_head(buf, hg, g2, first, share)
                    with reusing_sq_norm(hg, g2):  # the rule's sq_norm_last(g) of this g is g2 (not when hg is a view)
                        buf.add(w.layer, score(w.rule, w.module, saved, g, extra), span, factor)
                else:
                    buf.add(w.layer, score(w.rule, w.module, saved, g, extra), span, factor)
            buf.scored_modules.add(w.name)
        except Exception as exc:  # never raise into the training loop: counted, the module left unscored
            buf.hook_errors += 1
            buf.first_error = buf.first_error or f"{w.name} (backward): {type(exc).__name__}: {exc}"
            log.debug("gradloc: backward hook failed on %s", w.name, exc_info=True)

    (fit.out if fit.replaced else out).register_hook(on_grad)  # under TP: the DTensor output (its gradient flows)
    return fit.out if fit.replaced else None

