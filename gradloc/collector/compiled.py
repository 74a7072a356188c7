"""Per-token scores inside torch.compile graphs: an identity autograd tap per module call whose
backward hands the rule's score back as the gradient of a per-module "sink" leaf.

Inside a compiled region a module's forward hooks run only while dynamo traces them, and a tensor
hook on an intermediate needs compiled autograd (an error under ``fullgraph=True``; pytorch#172020).
So under compile (``torch.compiler.is_compiling()``) the forward hook of a watched module instead
returns ``Tap.apply(out, sink, saved)``: the identity on the module's output, whose backward
returns ∂L/∂y unchanged and, as the gradient of ``sink`` — a (B, T) float32 leaf gradloc creates per
micro-batch and per watched module — the rule's score ``rule.score(module, saved, ∂L/∂y)``. Autograd
accumulates it into ``sink.grad`` like any leaf gradient, so it works whole-graph and per block,
with ``fullgraph=True``, with no Python hook running at backward time, no host sync and no graph
break; the eager hooks' numbers come out (``tests/collector/test_compiled.py``). ``sink.grad`` is
read once the step ends (``fold``).

The hook reads only this module's persistent :class:`TapState` (never the micro-batch object,
which is new each micro-batch), so dynamo's guards stay stable: a compiled region traces once per
(active, B, T), not per micro-batch. The first traced call, before gradloc knows the model is
compiled, finds no sinks: it asks for them (``wanted``) and scores nothing; the next micro-batch
brings sinks and dynamo re-traces once. Not under compile: the per-sample surprise (the LM head's
output gradient at the label ids) and activation-checkpointing re-runs — a compiled region is one
call.
"""
from __future__ import annotations

from typing import Any

import torch

from gradloc.collector.fit import fit_call, score
from gradloc.collector.rules.registry import TokenRule


class TapState:
    """What a compiled hook reads: whether a micro-batch block is open, its (B, T), the sinks."""

    def __init__(self) -> None:
        self.active = False
        self.batch = 0
        self.seq = 0
        self.sinks: list[torch.Tensor] | None = None  # one (B, T) float32 leaf per watched module
        self.wanted = False  # a compiled region traced a watched module: create sinks from now on
        self.last = -1  # watched index of the last module tapped in forward (replayed on every run)


def make_tap(rule: TokenRule, module: torch.nn.Module) -> type[torch.autograd.Function]:
    """The tap of one watched module: identity forward, backward adds the rule's score to the sink."""

    class Tap(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, out: torch.Tensor, sink: torch.Tensor, saved: Any, extra: int) -> torch.Tensor:
            ctx.shape, ctx.extra = sink.shape, extra
            ctx.has_saved = isinstance(saved, torch.Tensor)
            if ctx.has_saved:
                ctx.save_for_backward(saved)
            return out.view_as(out)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
            saved = ctx.saved_tensors[0] if ctx.has_saved else None
            s = score(rule, module, saved, g, ctx.extra).float().reshape(ctx.shape)  # lead -> (B, T)
            return g, s, None, None

    return Tap


def tap(state: TapState, index: int, rule: TokenRule, module: torch.nn.Module, fn: type, args: tuple,
        out: Any) -> torch.Tensor | None:
    """The compiled path of a watched module's forward hook: the tapped output, or None (unchanged)."""
    whole = out
    out = rule.output(out) if hasattr(rule, "output") else out  # a router's logits, first of a tuple
    if not state.active or not args or not isinstance(out, torch.Tensor) or not out.requires_grad:
        return None
    if state.sinks is None:
        state.wanted = True
        return None
    if not getattr(rule, "compilable", True):
        return None  # its sink gets no gradient: unscored, said once (engine/token_path.py)
    fit = fit_call(rule, module, args[0], out, state.batch, state.seq)
    if fit is None:
        return None  # not scorable per position: the module stays unscored (its gradient unattributed)
    with torch.no_grad():
        saved = rule.capture(module, fit.x, fit.out)
    state.last = index
    tapped = fn.apply(fit.out, state.sinks[index], saved, fit.extra)
    return (tapped, *whole[1:]) if whole is not out else tapped


def new_sinks(devices: list[torch.device], batch: int, seq: int) -> list[torch.Tensor]:
    return [torch.zeros(batch, seq, device=d, requires_grad=True) for d in devices]


__all__ = ["TapState", "make_tap", "new_sinks", "tap"]
