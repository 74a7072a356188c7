"""Megatron-core's sequence parallelism (``sequence_parallel=True``): per-token scores from factors combined at the
step's one token-group all-reduce (``parallel/tokens.py``), never a collective inside a hook.

Under SP the residual stream is split by sequence over the tp group: tp rank r holds positions
``[r·s/tp, (r+1)·s/tp)`` (Megatron's ``_split_along_first_dim``). What each watched module's hook sees:

- a **column-parallel** linear gets its rank's sequence shard ``[s/tp, b, h]`` and all-gathers it *inside* its
  autograd function; its output ``[s, b, o/tp]`` covers every position. Position p routes g_p^(r) a_pᵀ into
  ∇W_r, so the whole layer's score is ‖a_p‖²·Σ_r ‖g_p^(r)‖² (+ Σ_r ‖g_p^(r)‖² for its split bias). Rank r knows
  ‖a_p‖² only for its own positions (the *owned* factor) and ‖g_p^(r)‖² for all (the *full* factor);
- a **row-parallel** linear gets the whole sequence of its input slice ``[s, b, i/tp]`` and reduce-scatters its
  output to ``[s/tp, b, h]``: the score is ‖g_p‖²·Σ_r ‖a_p^(r)‖², ‖g_p‖² known only on p's owner (owned), the
  input slices' ‖a_p^(r)‖² on every rank for every position (full); its bias (replicated, marked
  ``sequence_parallel``: Megatron all-reduces its gradient over tp in ``finalize_model_grads``) gets g_p from p's
  owner only: ‖g_p‖² there, counted once (factor 1);
- a module whose parameters Megatron marks ``sequence_parallel`` (the LayerNorms of the SP region, whose
  gradients are all-reduced the same way) runs on its rank's positions only: its rule's score placed at their
  offset (factor 1: the ranks' positions are disjoint).

So every linear's weight term is (Σ_r owned_r[p])·(Σ_r full_r[p]), owned_r zero off r's positions: each rank
adds its two factors per linear and call into ``MicroBatchScores.pairs`` (slot = the linear), the token group's
all-reduce sums them with everything else, and ``tokens.combine`` forms the products (the layer's row, the
totals, the exact row). The additive parts (biases, the norms) go into the ordinary rows. The products are exact,
§3 of DESIGN.md, as without SP.

Limits (refused at attach by :func:`check_model`, with the reason): a pipeline-parallel token group (its stages
hold different linears: the slots would not line up), a module from ``megatron.*`` with trainable parameters other
than the two parallel linears (e.g. ``VocabParallelEmbedding``, which reduce-scatters into the SP region, or
Transformer Engine's fused layers), a module mixing ``sequence_parallel`` parameters with others, and one whose
``sequence_parallel`` parameters have no per-token rule or a rule other than the norms' (LayerNorm, RMSNorm). A
linear called twice in one micro-batch keeps its first call; the second is a dropped call (counted, its gradient
unattributed). The per-sample surprise reads a column-parallel head's vocabulary shard as without SP (its output
gradient covers every position). Norms on a batch-first view ``(b, s/tp, h)`` are placed (the torch rules' (B, T)
lead), and so is a torch norm a Megatron module calls on ``[s/tp, b, h]`` (rules/megatron.SequenceFirstNorm, read as
(b, s/tp); not run here: Megatron's own SP norms are Transformer Engine's or apex's, neither installed).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from gradloc.collector.head_read import read_head
from gradloc.collector.rules.layer_norm import LayerNormRule
from gradloc.collector.rules.megatron import (
    MegatronLinearRule,
    _bias_gets_gradient,
    _column,
    _own_slice,
    is_megatron_linear,
    sp_marked,
)
from gradloc.collector.rules.registry import rule_for, sq_norm_last
from gradloc.collector.rules.rms_norm import HFRMSNormRule, TorchRMSNormRule
from gradloc.collector.shards import Span
from gradloc.errors import UnsupportedModelError

log = logging.getLogger("gradloc")
_NORM_RULES = (LayerNormRule, TorchRMSNormRule, HFRMSNormRule)


def check_model(model: nn.Module, pp: int = 1) -> None:
    """Refuse what cannot be scored exactly under SP (the module docstring's limits), naming it."""
    if pp > 1:
        raise UnsupportedModelError("gradloc: Megatron sequence_parallel=True with pipeline parallelism is not "
                                    "supported (the stages' per-token factors would not line up)")
    for name, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if not own or is_megatron_linear(m):
            continue
        marked = [getattr(p, "sequence_parallel", False) for p in own]
        why = ""
        if type(m).__module__.startswith("megatron."):
            why = "a Megatron layer gradloc does not score under sequence parallelism"
        elif any(marked) and not all(marked):
            why = "some of its parameters are marked sequence_parallel, others not"
        elif all(marked) and not isinstance(rule_for(m), _NORM_RULES):
            why = "its sequence_parallel parameters have no norm rule (LayerNorm, RMSNorm)"
        if why:
            raise UnsupportedModelError(f"gradloc: {name} ({type(m).__name__}) under Megatron sequence_parallel=True: "
                                        f"{why}; its per-token scores cannot be formed exactly")


def configure(hooks: Any, rank: int, size: int) -> None:
    """Replace the SP linears' and SP norms' rules by the ones here (``takes_over``: ``capture_routed``)."""
    from gradloc.collector.watched import WatchedModule

    slot = 0
    for i, w in enumerate(hooks.watched):
        if is_megatron_linear(w.module) and getattr(w.module, "sequence_parallel", False):
            rule: Any = SPLinearRule(slot, rank, size)
            slot += 1
        elif sp_marked(w.module):
            rule = SPShardRule(w.rule, rank, size)
        else:
            continue
        hooks.watched[i] = WatchedModule(w.name, w.module, rule, w.layer, w.site)
    hooks.pair_slots = slot


def bias_counts(module: nn.Module, column: bool) -> bool:
    """Whether the linear's bias trains and gets a gradient from its call (scored additively: ‖g_p‖², the column
    rank's split bias, or the row bias on p's owner only, counted once)."""
    bias = getattr(module, "bias", None)
    return isinstance(bias, nn.Parameter) and bias.requires_grad and \
        _bias_gets_gradient(module, column, getattr(module, "weight", None))


def _enter(w: Any, buf: Any) -> int | None:
    """token_hooks._capture's call bookkeeping for a taken-over call; None: a recomputation to skip."""
    from gradloc.collector.token_hooks import _graph_task_id

    recompute = _graph_task_id() != -1
    calls = buf.recompute_calls if recompute else buf.forward_calls
    calls[w.name] = n = calls.get(w.name, 0) + 1
    if recompute and n <= buf.forward_calls.get(w.name, 0):
        return None
    buf.matched_calls += 1
    buf.matched_modules.add(w.name)
    if recompute:
        return 0
    buf.last_layer = w.layer
    buf.calls += 1
    buf.last_call = buf.calls
    return buf.calls


def _drop(w: Any, buf: Any) -> None:
    buf.dropped_calls += 1
    buf.dropped_layers.add(w.layer)
    buf.lost_modules.add(w.name)


def _guard(w: Any, buf: Any, fn: Any) -> Any:
    def on_grad(g: torch.Tensor) -> None:
        try:
            with torch.no_grad():
                fn(g)
            buf.scored_modules.add(w.name)
        except Exception as exc:  # never raise into the training loop: counted, the module left unscored
            buf.hook_errors += 1
            buf.first_error = buf.first_error or f"{w.name} (backward): {type(exc).__name__}: {exc}"
            log.debug("gradloc: sequence-parallel score failed on %s", w.name, exc_info=True)
    return on_grad


class SPLinearRule:
    """A Megatron parallel linear under SP: its weight term as two factors (``pairs`` slot), its bias additive."""

    compilable = False
    takes_over = True  # token_hooks._capture hands the call to ``capture_routed``

    def __init__(self, slot: int, rank: int, size: int) -> None:
        self.slot, self.rank, self.size = slot, rank, size

    def output(self, out: object) -> object:
        """``output``, first of the layer's ``(output, output_bias)``."""
        return out[0] if isinstance(out, tuple) and out else out

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        return (y.shape[1], y.shape[0]) if y.dim() == 3 else ()  # [s, b, h] -> (b, s)

    def capture_routed(self, w: Any, buf: Any, args: tuple, out: Any) -> None:
        y, x = self.output(out), args[0] if args else None
        if not isinstance(y, torch.Tensor) or not y.requires_grad or not isinstance(x, torch.Tensor):
            return
        column = _column(w.module)
        B, T = buf.batch, buf.seq
        shard = x if column else y  # the sequence shard: [s/tp, b, h]
        whole = y if column else x  # every position: [s, b, h]
        if (x.dim() != 3 or y.dim() != 3 or shard.shape[0] * self.size != T or whole.shape[0] != T
                or x.shape[1] != B or y.shape[1] != B or self.slot in buf.pair_layers):
            _drop(w, buf)  # not this micro-batch's [s, b] under SP, or a second call (its slot is taken)
            return
        call = _enter(w, buf)
        if call is None:
            return
        n = T // self.size
        span = Span(1, self.rank * n, n)  # this rank's positions along T
        weight = getattr(w.module, "weight", None)
        pair = isinstance(weight, nn.Parameter) and weight.requires_grad
        buf.pair_layers[self.slot] = w.layer
        buf.pair_names[self.slot] = w.name
        a_sq = sq_norm_last(x.detach()) if pair else None  # [s', b, h] -> [s', b]

        bias = bias_counts(w.module, column)
        head = buf.labels is not None and call and column  # the loss head's u_p (token_hooks._capture's read)

        def score(g: torch.Tensor) -> None:
            if head and call == buf.last_call:  # this rank's vocabulary shard of every position (rules/megatron.py)
                hg, first, share = MegatronLinearRule().head_view(w.module, g)
                read_head(buf, hg, sq_norm_last(hg), first, share)  # (B, T, V') -> (B, T) reads
            if column:  # a gathered output's gradient is whole: the weight sees this rank's slice
                g = _own_slice(g, w.module.output_size, self.rank, self.size)  # [s, b, o] -> [s, b, o/tp]
            g_sq = sq_norm_last(g)  # [s', b, h] -> [s', b]
            if pair:
                own, full = (a_sq, g_sq) if column else (g_sq, a_sq)
                buf.add_pair(self.slot, own.t(), full.t(), span)  # [s', b] -> (b, s')
            if bias:
                buf.add(w.layer, g_sq.t(), None if column else span, 1.0)  # [s', b] -> (b, s')

        y.register_hook(_guard(w, buf, score))


class SPShardRule:
    """A norm whose parameters Megatron marks ``sequence_parallel``: its own rule on this rank's positions."""

    compilable = False
    takes_over = True

    def __init__(self, inner: Any, rank: int, size: int) -> None:
        self.inner, self.rank, self.size = inner, rank, size

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        return self.inner.lead_shape(module, x, y)

    def capture_routed(self, w: Any, buf: Any, args: tuple, out: Any) -> None:
        x = args[0] if args else None
        if not isinstance(out, torch.Tensor) or not out.requires_grad or not isinstance(x, torch.Tensor):
            return
        lead = self.inner.lead_shape(w.module, x, out)
        n = buf.seq // self.size
        if lead != (buf.batch, n) or n * self.size != buf.seq:
            _drop(w, buf)  # not (B, T/tp) batch-first
            return
        if _enter(w, buf) is None:
            return
        saved = self.inner.capture(w.module, x, out)
        span = Span(1, self.rank * n, n)

        def score(g: torch.Tensor) -> None:
            buf.add(w.layer, self.inner.score(w.module, saved, g), span, 1.0)  # (B, T/tp) at this rank's positions

        out.register_hook(_guard(w, buf, score))


__all__ = ["SPLinearRule", "SPShardRule", "check_model", "bias_counts", "configure"]
