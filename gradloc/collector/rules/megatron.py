"""Megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` (``megatron.core.tensor_parallel``): plain
``nn.Module``s computing y_p = W a_p (+ b) on **sequence-first** activations ``[s, b, h]`` and returning a tuple
``(output, output_bias)``. Recognised by duck typing (class name + module path ``megatron.*``); megatron is
never imported here.

Positions. The hooks place a rule's scores by the micro-batch's (B, T); Megatron's lead is (s, b), so this
rule reports its lead as (b, s) and returns its scores transposed to (b, s) (a 3-D input is taken to be
``[s, b, h]``, the layers' documented contract). Only 3-D calls are placed: a flattened ``[s·b, h]`` call (MoE experts' routed token rows) reports lead () and is dropped, its
gradient counted unattributed, never misplaced.

What one tp rank r scores (its weight is ``tensor_model_parallel``: the TP view counts it with factor 1, so
these terms are exactly r's share, and the tp group's sum is the whole layer's ‖g_p a_pᵀ‖² + ‖g_p‖²):

- **column-parallel** (W split by output features): r computes y_p^(r) = W_r a_p + b_r on the whole input, so
  it routes g_p^(r) a_pᵀ into ∇W_r and g_p^(r) into ∇b_r (the bias is split too): ‖g_p^(r)‖²·‖a_p‖² +
  ‖g_p^(r)‖². With ``gather_output=True`` (or ``runtime_gather_output``) the output is all-gathered and the
  hook's gradient is the whole g_p, identical on every rank; the weight only ever sees r's slice
  (``mappings._split_along_last_dim`` in the gather's backward), so the rule narrows g to that slice —
  recognised by the output's width (``output_size`` instead of ``output_size_per_partition``);
- **row-parallel** (W split by input features): r computes W_r a_p^(r) on its input slice, all-reduced, then
  adds the replicated bias. g_p (after the reduction) is whole and the same on every rank: ‖g_p‖²·‖a_p^(r)‖²
  for the weight (the ranks' input slices add up to ‖a_p‖²), and ‖g_p‖²/tp for the bias, whose gradient is
  whole on every rank (counted once over the group). With ``input_is_parallel=False`` the layer scatters a
  whole input itself: the rule narrows a to r's slice (the input's width says which case it is).

A column-parallel bias added inside the layer (``skip_bias_add=False``) while the weight is frozen gets no
gradient at all (Megatron's ``LinearWithFrozenWeight`` returns None for it): scored 0, since it never trains.

``skip_bias_add=True``: the layer returns the bias for the caller to add (Megatron's bias-GELU/SwiGLU and
bias-dropout-add fusions compute ``output + bias`` per position). Then ∂L/∂b = Σ_p ∂L/∂(output + b)_p = Σ_p g_p
with g_p the gradient the hook sees on ``output``, so the bias term is the same ‖g_p‖² (/tp for the
row-parallel one) and is **exact when the caller adds the bias to the output unchanged**; a caller that uses
the returned bias any other way makes that term an attribution (it is never left out: a missing term would
vanish from the token scores without being counted unattributed).

Exactness is §3 of DESIGN.md's: each term is the exact norm² of what position p routes into that parameter;
for layers before the last cross-position mixing it is an attribution of the step's gradient.

Sequence parallelism (``sequence_parallel=True``) is scored by ``parallel/megatron_sp.py``, not here: there the
column-parallel input is a sequence shard ``[s/tp, b, h]`` all-gathered *inside* the layer's autograd function,
and the row-parallel output is reduce-scattered, so no hook holds both factors of a position's weight term; the
Megatron backend replaces this rule on such layers by one that gives the factors to the step's token-group
all-reduce. A layer whose
weight is passed to ``forward`` (``skip_weight_param_allocation=True``: Megatron's tied output layer) has no
weight of its own: only its bias (if any) is scored here, and what its call routes into the passed weight is
missing from the token scores without being counted unattributed (that weight's owner, the embedding, is
scored for its own call).
"""
from __future__ import annotations

import torch
from torch import nn

from gradloc.collector.rules.layer_norm import LayerNormRule
from gradloc.collector.rules.registry import register_duck_rule, sq_norm_last
from gradloc.collector.rules.rms_norm import HFRMSNormRule, TorchRMSNormRule

_CLASSES = ("ColumnParallelLinear", "RowParallelLinear")


def is_megatron_linear(module: nn.Module) -> bool:
    return type(module).__name__ in _CLASSES and type(module).__module__.startswith("megatron.")


def is_megatron_module(module: nn.Module) -> bool:
    """A module defined by megatron (``megatron.*``): by its contract, it passes activations sequence-first to the
    modules it calls (``TransformerBlock`` to its ``final_layernorm``, whatever class that norm is: Megatron's
    ``WrappedTorchNorm`` / ``TENorm`` build torch's or Transformer Engine's own norms)."""
    return type(module).__module__.startswith("megatron.")


def sp_marked(module: nn.Module) -> bool:
    """Whether ``module``'s own trainable parameters are all marked ``sequence_parallel`` (and some exist): Megatron
    marks the parameters of the modules that run on a sequence-parallel region's shard (its norms)."""
    ps = [p for p in module.parameters(recurse=False) if p.requires_grad]
    return bool(ps) and all(getattr(p, "sequence_parallel", False) for p in ps)


class SequenceFirstNorm:
    """A torch norm (LayerNorm, RMSNorm) that a Megatron module calls on its hidden states ``[s, b, h]`` — Megatron's
    ``WrappedTorchNorm`` builds torch's own norms, and ``TransformerLayer`` / ``TransformerBlock`` call them
    sequence-first: the norm's rule, its lead reported as (b, s) and its scores transposed to (b, s). A norm called
    per head (Megatron's q/k layernorm on ``[s, b, heads, d]``) reports (b, s, heads): the heads share its
    parameters, so each position's gradient is summed over them before squaring (``score_grouped``, collector/fit.py),
    as for HF's per-head norms. ``per_head=False`` — the caller splits its heads over tensor-parallel ranks — leaves
    such a call unplaced (dropped, counted): each rank holds its heads' part of a position's gradient, which
    Megatron sums over tp (``finalize_model_grads``), and the square of that sum needs every rank's part."""

    def __init__(self, inner: object, per_head: bool = True) -> None:
        self.inner, self.per_head = inner, per_head

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        lead = self.inner.lead_shape(module, x, y)
        if len(lead) < 2 or (len(lead) > 2 and not self.per_head):
            return ()  # not a position layout; or a tp rank's part of its heads
        return (lead[1], lead[0], *lead[2:])  # [s, b, *h] -> (b, s, *h)

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> object:
        return self.inner.capture(module, x, y)

    def score(self, module: nn.Module, saved: object, g: torch.Tensor) -> torch.Tensor:
        return self.score_grouped(module, saved, g, 0)

    def score_grouped(self, module: nn.Module, saved: object, g: torch.Tensor, extra: int) -> torch.Tensor:
        return self.inner.score_grouped(module, saved, g, extra).t().contiguous()  # [s, b] -> (b, s)


def sequence_first_view(rule: object, caller: nn.Module | None) -> object:
    """``rule`` as the hooks should apply it to a module ``caller`` calls: a norm's wrapped when the caller is
    Megatron's (:class:`SequenceFirstNorm`), any other rule as it is (Megatron's embeddings are called
    batch-first, its parallel linears' rule reads ``[s, b, h]`` itself)."""
    norm = isinstance(rule, (LayerNormRule, TorchRMSNormRule, HFRMSNormRule))
    if not (norm and caller is not None and is_megatron_module(caller)):
        return rule
    tp = getattr(getattr(caller, "config", None), "tensor_model_parallel_size", 1)
    return SequenceFirstNorm(rule, per_head=not (isinstance(tp, int) and tp > 1))


def _column(module: nn.Module) -> bool:
    return type(module).__name__ == "ColumnParallelLinear"


def tp_rank_size(module: nn.Module) -> tuple[int, int]:
    """(rank, size) of the layer's tensor-parallel group, from its own partition sizes and ``tp_group``."""
    if _column(module):
        size = module.output_size // module.output_size_per_partition
    else:
        size = module.input_size // module.input_size_per_partition
    group = getattr(module, "tp_group", None)
    return (group.rank() if size > 1 and group is not None else 0), size


def _own_slice(t: torch.Tensor, whole: int, rank: int, size: int) -> torch.Tensor:
    """[s, b, whole] -> [s, b, whole/tp]: rank's chunk of the features (Megatron's split along the last dim)."""
    if size == 1 or t.shape[-1] != whole:
        return t  # already this rank's slice
    n = whole // size
    return t.narrow(-1, rank * n, n)  # [s, b, h] -> [s, b, h/tp]


def _bias_gets_gradient(module: nn.Module, column: bool, weight: object) -> bool:
    """False for a column-parallel bias added inside the layer while its weight is frozen: Megatron then runs
    ``LinearWithFrozenWeight``, whose backward returns no bias gradient (the bias never trains)."""
    frozen = isinstance(weight, nn.Parameter) and not weight.requires_grad
    return not (column and frozen and not getattr(module, "skip_bias_add", False))


@register_duck_rule(is_megatron_linear)
class MegatronLinearRule:
    def output(self, out: object) -> object:
        """The tensor the rule scores: ``output``, first of ``(output, output_bias)``."""
        return out[0] if isinstance(out, tuple) and out else out

    def lead_shape(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, ...]:
        if y.dim() != 3:
            return ()  # not [s, b, h]: no (b, s) positions to report (dropped, counted unattributed)
        return (y.shape[1], y.shape[0])  # [s, b, h] -> (b, s)

    def capture(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """‖a_p^(r)‖² [s, b]: the input features this rank's weight multiplies (float32)."""
        if not _column(module):  # row-parallel: a whole input is scattered inside (input_is_parallel=False)
            rank, size = tp_rank_size(module)
            x = _own_slice(x, module.input_size, rank, size)  # [s, b, h] -> [s, b, h/tp]
        return sq_norm_last(x)  # [s, b, h_in] -> [s, b]

    def score(self, module: nn.Module, saved: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """This rank's share of each position's ‖∇‖² contribution, float32 (b, s)."""
        rank, size = tp_rank_size(module)
        column = _column(module)
        if column:  # a gathered output's gradient is whole: the weight sees this rank's slice
            g = _own_slice(g, module.output_size, rank, size)  # [s, b, h] -> [s, b, h/tp]
        g_sq = sq_norm_last(g)  # [s, b, h_out] -> [s, b]
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        w_trains = isinstance(weight, nn.Parameter) and weight.requires_grad
        score = g_sq * saved if w_trains else torch.zeros_like(g_sq)
        if isinstance(bias, nn.Parameter) and bias.requires_grad and _bias_gets_gradient(module, column, weight):
            score = score + (g_sq if column else g_sq / size)  # the row-parallel bias: once over the tp ranks
        return score.t().contiguous()  # [s, b] -> (b, s)

    def head_view(self, module: nn.Module, g: torch.Tensor) -> tuple[torch.Tensor, int, float]:
        """The loss head's output gradient as the per-sample surprise reads it (token_hooks._head_u): (g batch-first
        ``(b, s, cols)``, the vocabulary column its first column is, the share of u this rank's read counts). A
        column-parallel head (Megatron's output layer, vocab-parallel cross entropy): this rank's vocabulary
        shard from column rank·v/tp (a gathered output narrowed to it), the tp ranks' parts adding up; a
        row-parallel one: the whole, reduced gradient on every rank, each counting 1/tp."""
        rank, size = tp_rank_size(module)
        if _column(module):
            g = _own_slice(g, module.output_size, rank, size)  # [s, b, v] -> [s, b, v/tp]
            return g.transpose(0, 1), rank * module.output_size_per_partition, 1.0  # -> (b, s, v/tp)
        return g.transpose(0, 1), 0, 1.0 / size  # [s, b, v] -> (b, s, v)


__all__ = ["MegatronLinearRule", "SequenceFirstNorm", "is_megatron_linear", "is_megatron_module", "sequence_first_view",
           "sp_marked", "tp_rank_size"]
