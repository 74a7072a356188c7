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

Other compiled models in the process (a reference policy, an EMA copy, a teacher): dynamo caches graphs
per code object (a class's ``forward``), and by default it does not guard on a module's *empty* hook
dicts (``torch._dynamo.config.skip_nnmodule_hook_guards``). A graph traced for an unwatched instance
of the same class would then run for the watched one too, without the taps. :func:`guard_hooks`
(at attach) turns those guards on and drops the graphs traced before without them, so each instance
gets its own graph; a graph that still runs without the taps is noticed (``TapState.reached``) and
said (engine/token_path.py).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from gradloc.collector.fit import fit_call, score
from gradloc.collector.rules.registry import TokenRule
from gradloc.collector.shards import is_dtensor

log = logging.getLogger("gradloc")


class TapState:
    """What a compiled hook reads: whether a micro-batch block is open, its (B, T), the sinks."""

    def __init__(self) -> None:
        self.active = False
        self.batch = 0
        self.seq = 0
        self.sinks: list[torch.Tensor] | None = None  # one (B, T) float32 leaf per watched module
        self.wanted = False  # a compiled region traced a watched module: create sinks from now on
        self.last = -1  # watched index of the last module tapped in forward (replayed on every run)
        self.reached = False  # a traced hook ran in this micro-batch's forward (replayed on every run)


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
        out: Any, caller: torch.nn.Module | None = None, site: torch.nn.Module | None = None) -> torch.Tensor | None:
    """The compiled path of a watched module's forward hook: the tapped output, or None (unchanged).
    ``caller``: the module the hook ran on; ``site``: the one it was registered on (a copy of the model,
    ``copy.deepcopy`` after watch, carries the hook: it is not tapped, and its graph is told apart from
    the watched model's by the identity guard ``id()`` installs)."""
    whole = out
    out = rule.output(out) if hasattr(rule, "output") else out  # a router's logits, first of a tuple
    if not state.active or not args or not isinstance(out, torch.Tensor) or not out.requires_grad:
        return None
    region = in_region()  # inside a higher-order op (a checkpointed block): no Python side effect allowed
    if state.sinks is None:
        if not region:
            state.wanted = True
        return None
    if caller is not None and id(caller) != id(site):
        return None
    if not region:
        state.reached = True  # a store of a constant: no guard, dynamo replays it whenever the graph runs
    if not getattr(rule, "compilable", True) or is_dtensor(out) or is_dtensor(args[0]):
        return None  # its sink gets no gradient: unscored, said once (engine/token_path.py); a tensor-parallel
        # module's DTensors need the shard placement the eager hooks do (token_hooks.py, shards.py), not done here
    fit = fit_call(rule, module, args[0], out, state.batch, state.seq)
    if fit is None:
        return None  # not scorable per position: the module stays unscored (its gradient unattributed)
    with torch.no_grad():
        saved = rule.capture(module, fit.x, fit.out)
    if not region:
        state.last = index
    tapped = fn.apply(fit.out, state.sinks[index], saved, fit.extra)
    return (tapped, *whole[1:]) if whole is not out else tapped


@torch._dynamo.assume_constant_result  # called at trace time, its answer a constant of the graph (no guard)
def in_region() -> bool:
    """Whether dynamo is tracing the body of a higher-order op (``torch.utils.checkpoint`` in a compiled
    region), where a store to a Python object is refused (an error under ``fullgraph=True``)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return not InstructionTranslator.current_tx().output.is_root_tracer()
    except Exception:  # noqa: BLE001 - not tracing, or another torch: the root graph
        return False


def guard_hooks(instances: int = 1) -> int:
    """From now on dynamo guards on every module's hook dicts, empty ones included, so a graph traced for a
    module without gradloc's hooks never runs for a watched one (nor the reverse); graphs traced before,
    without those guards, are dropped (they retrace on their next call). Returns how many code objects
    lost their graphs; -1 where this torch offers no way to (then an untapped graph is said, not fixed).

    ``instances``: the most instances of one class that hold watched modules (the blocks). Each block's
    taps read its own sink index, so a block compiled on its own traces once per instance: dynamo's
    ``recompile_limit`` (8 per code object) is raised to ``instances + 8`` where lower — else the ninth
    block falls back to eager, or fails the step under ``fullgraph=True`` (FailOnRecompileLimitHit)."""
    try:
        import torch._dynamo as dynamo
        from torch._dynamo import convert_frame
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
    except Exception:  # noqa: BLE001 - an older or newer torch: detection alone (TokenHooks.end)
        log.debug("gradloc: dynamo's hook guards not available", exc_info=True)
        return -1
    limit = getattr(dynamo.config, "recompile_limit", None)
    if isinstance(limit, int) and limit < instances + 8:
        dynamo.config.recompile_limit = instances + 8
    if not dynamo.config.skip_nnmodule_hook_guards:
        return 0  # already guarded (a monitor attached before, or the user's setting): nothing stale
    dynamo.config.skip_nnmodule_hook_guards = False
    dropped = 0
    try:
        with convert_frame.compile_lock:
            for ref in convert_frame.input_codes.seen + convert_frame.output_codes.seen:
                code = ref()
                if code is not None and _debug_get_cache_entry_list(code):
                    reset_code(code)
                    dropped += 1
    except Exception:  # noqa: BLE001 - never raise into the caller's set-up: the detection stays
        log.debug("gradloc: could not drop graphs traced before watch()", exc_info=True)
        return -1
    if dropped:
        log.warning("gradloc: %d compiled graph(s) traced before watch() did not guard on module hooks; "
                    "they are dropped and retrace on their next call, so no model (watched or not) runs "
                    "another's graph", dropped)
    return dropped


def new_sinks(devices: list[torch.device], batch: int, seq: int) -> list[torch.Tensor]:
    return [torch.zeros(batch, seq, device=d, requires_grad=True) for d in devices]


__all__ = ["TapState", "guard_hooks", "make_tap", "new_sinks", "tap"]
