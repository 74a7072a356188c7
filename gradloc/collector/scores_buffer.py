"""The per-position score buffer of one micro-batch: what the token hooks (token_hooks.py) add into in backward.

``MicroBatchScores`` holds a ``(n_layers, B, T)`` (or, without the per-layer breakdown, ``(2, B, T)``) float32
buffer on the device plus the bookkeeping the step needs to trust it: which watched modules were called, which
scored, which were lost to a shape mismatch or a hook error. The collector owns it from the micro-batch block's
start until ``end_step`` stacks it (collector/token_summary.py).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gradloc.collector.rules.registry import TokenRule
from gradloc.collector.shards import Span

if TYPE_CHECKING:
    from gradloc.collector.watched import WatchedModule


@dataclass
class MicroBatchScores:
    """Mutable accumulator of one micro-batch; owned by the collector until ``end()``.

    With ``breakdown`` the buffer has one row per token layer (L, B, T); without it two rows
    (2, B, T): the sum over all layers, and the position-exact layer alone (the last watched module
    run in forward; known by the time backward delivers its gradient). Memory per micro-batch:
    rows × B × T × 4 bytes, held until ``end_step``.
    """

    index: int
    batch: int
    seq: int
    n_layers: int
    breakdown: bool = True
    scores: torch.Tensor | None = None  # (L, B, T) or (2, B, T) float32, created on the first score
    dropped_calls: int = 0  # module calls whose shape did not map onto (B, T)
    matched_calls: int = 0
    hook_errors: int = 0
    first_error: str = ""  # the first hook error's module and exception (said once by the monitor)
    dropped_layers: set[int] = field(default_factory=set)
    last_layer: int | None = None  # token layer of the last watched module called in forward
    forward_calls: dict[str, int] = field(default_factory=dict)  # module -> grad-tracking calls in forward
    recompute_calls: dict[str, int] = field(default_factory=dict)  # module -> calls re-run inside backward
    external_calls: dict[str, int] = field(default_factory=dict)  # module -> scores registered by external()
    # Modules by name: called with a matching shape / called but not scorable (shape, hook error) /
    # whose score actually arrived in backward. A called module that never scored contributed nothing
    # to the token scores, so its gradient counts as unattributed (see ``unscored``).
    matched_modules: set[str] = field(default_factory=set)
    lost_modules: set[str] = field(default_factory=set)
    scored_modules: set[str] = field(default_factory=set)
    # Per-sample surprise (collector/surprise.py): the ids each loss position scores, and at the last
    # forward call of the last watched module (the LM head) u_p = −g_p[id_p] = w·(1 − p(id_p)) for a
    # cross-entropy head (B, T); 0 where an id is not a column of the head's output.
    labels: torch.Tensor | None = None
    head_u: torch.Tensor | None = None
    head_g2: torch.Tensor | None = None  # ‖g_p‖² at the head (B, T), read with head_u
    shifts: int = 0  # K: the head's gradient at p ± 1 … K is read at p's label too (collector/head_read.py)
    head_shift: torch.Tensor | None = None  # (2K, B, T) g_{p+k}[label_p], read with head_u
    calls: int = 0  # grad-tracking forward calls captured so far (the last one is the head's)
    last_call: int = 0
    # under torch.compile (collector/compiled.py): one (B, T) sink leaf per watched module, whose
    # .grad holds that module's scores once backward ran; folded into ``scores`` by ``fold``
    sinks: list[torch.Tensor] | None = None
    sink_last: int = -1
    untapped: bool = False  # sinks were given, but the compiled graph that ran had no tap (compiled.py)
    # scores that reach their tokens only after the step's exchange (expert parallelism: parallel/ep.py)
    routed: list = field(default_factory=list)
    # Megatron sequence parallelism (parallel/megatron_sp.py): per linear (slot) its two factors (2, B, T), summed
    # over the token group before their product is formed (parallel/tokens.py); the slot's layer and module name
    pairs: dict[int, torch.Tensor] = field(default_factory=dict)
    pair_layers: dict[int, int] = field(default_factory=dict)
    pair_names: dict[int, str] = field(default_factory=dict)
    # the last input-only capture (``capture``): (rule type, id, version), a weak reference to the input, state
    last_capture: tuple | None = field(default=None, repr=False)

    def capture(self, rule: TokenRule, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
        """``rule.capture(module, x, y)``; for an ``input_only`` rule computed once for consecutive calls on the
        same, unmodified input (q/k/v on one normed activation: one ‖x_p‖² instead of three). Only a weak
        reference to the input is kept: no activation outlives autograd's own."""
        if not getattr(rule, "input_only", False) or not isinstance(x, torch.Tensor) or x.is_inference():
            return rule.capture(module, x, y)  # (an inference-mode input has no version counter to key on)
        key = (type(rule), id(x), x._version)
        last = self.last_capture
        if last is not None and last[0] == key and last[1]() is x:
            return last[2]
        saved = rule.capture(module, x, y)
        self.last_capture = (key, weakref.ref(x), saved)
        return saved

    def fold(self, watched: "list[WatchedModule]") -> None:
        """Add the compiled taps' scores (``sinks``) into the buffer, once, after backward."""
        sinks, self.sinks = self.sinks, None
        if sinks is None:
            return
        if 0 <= self.sink_last < len(watched) and self.last_layer is None:
            self.last_layer = watched[self.sink_last].layer
        for w, sink in zip(watched, sinks):
            self.matched_modules.add(w.name)  # called or not: one without a gradient adds nothing unattributed
            if sink.grad is not None:
                self.matched_calls += 1
                try:
                    self.add(w.layer, sink.grad.detach())
                except Exception as exc:  # noqa: BLE001 - never raise into the training loop: counted, unscored
                    self.hook_errors += 1
                    self.first_error = self.first_error or f"{w.name} (compiled tap): {type(exc).__name__}: {exc}"
                    continue
                self.scored_modules.add(w.name)

    @property
    def unscored(self) -> set[str]:
        return (self.matched_modules | self.lost_modules) - self.scored_modules

    def add(self, layer: int, score: torch.Tensor, span: Span | None = None, factor: float = 1.0) -> None:
        """``span``: the score covers only these positions (a sequence-sharded call under TP);
        ``factor``: what this rank's score counts (1/tp where every tp rank computes the same)."""
        if span is None:
            s = score.reshape(self.batch, self.seq)  # (*lead) -> (B, T)
        else:
            s = score.reshape((self.batch, span.length) if span.dim == 1 else (span.length, self.seq))  # -> its slice
        if factor != 1.0:
            s = s * factor
        if self.scores is None:
            rows = self.n_layers if self.breakdown else 2
            self.scores = torch.zeros(rows, self.batch, self.seq, device=s.device)
        s = s.to(self.scores.device)  # a model spread over devices: the scores gather on one of them
        rows = [layer] if self.breakdown else ([0, 1] if layer == self.last_layer else [0])
        for r in rows:
            target = self.scores[r]
            if span is not None:
                target = target.narrow(span.dim, span.offset, span.length)  # (B, T) -> this rank's positions
            target += s

    def add_pair(self, slot: int, own: torch.Tensor, full: torch.Tensor, span: Span) -> None:
        """A sequence-parallel linear's factors: ``own`` over this rank's positions (``span``), ``full`` over all."""
        pair = self.pairs.get(slot)
        if pair is None:
            pair = self.pairs[slot] = torch.zeros(2, self.batch, self.seq, device=full.device)
        pair[0].narrow(span.dim, span.offset, span.length).add_(own.reshape(  # (b, s/tp) -> its slice of (B, T)
            (self.batch, span.length) if span.dim == 1 else (span.length, self.seq)).to(pair.device))
        pair[1].add_(full.reshape(self.batch, self.seq).to(pair.device))  # (b, s) -> (B, T)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(Σ over layers (B, T), exact layer (B, T) or None, per layer (L, B, T) or None)."""
        assert self.scores is not None
        if not self.breakdown:
            return self.scores[0], self.scores[1], None
        exact = self.scores[self.last_layer] if self.last_layer is not None else None
        return self.scores.sum(0), exact, self.scores
