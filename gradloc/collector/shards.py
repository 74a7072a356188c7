"""A watched module's call under tensor parallelism: what this rank's piece of each position's score is.

Under DTensor TP the hooks run before the parallel styles' own output hooks (``TokenHooks.prepend``),
so they see the module's input and output as DTensors on the tp mesh. Scores are computed from the
local shards, and the token group sums them once per step; what a rank's local score is:

- **features split** (a column-parallel output, a row-parallel input, a vocabulary shard's rows): each
  rank routes a disjoint part of position p's contribution into its own shard of the parameters, so
  the ranks' scores add up to the whole — factor 1;
- **positions split** (an output DTensor ``Shard`` on a lead dim, SequenceParallel's norms): each rank
  scores its own positions, placed at their offset in the micro-batch's (B, T) — factor 1;
- **computed the same on every rank** (every parameter ``Replicate`` on tp, or plain tensors, and a
  replicated output): every rank's score is the whole, so each counts 1/tp.

``Partial`` outputs (a row-parallel linear's before its reduction) carry a replicated gradient: its
weight is split by input features (factor 1); its replicated bias is counted once by the linear rule
(``rules/linear.py``: ``row_bias_factor``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor — by ``isinstance``, which dynamo answers at trace time (an attribute probe on a
    traced DTensor is not). Read from ``sys.modules``: a job that never imported DTensor holds none, and pays no
    import for asking."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: Any) -> Any:
    return t.to_local() if is_dtensor(t) else t


@dataclass(frozen=True)
class Span:
    """Where a call's positions sit in the micro-batch: ``length`` of them along lead ``dim`` from ``offset``."""

    dim: int
    offset: int
    length: int


@dataclass(frozen=True)
class ShardView:
    x: Any  # the call's first input, local
    out: torch.Tensor  # its output, local
    factor: float  # this rank's score counts this much (1/tp when every tp rank computes the same)
    span: Span | None  # positions split over the tp ranks: this rank's
    features: int = 0  # where this rank's slice of the output's last dim starts (a vocabulary-parallel head's columns)


@dataclass(frozen=True)
class TPContext:
    """What the hooks need of the tensor-parallel layout (set by the TP backend; None outside TP)."""

    size: int  # tp ranks
    dim_name: str = "tp"

    def view(self, module: nn.Module, x: Any, out: torch.Tensor, lead: int) -> ShardView:
        """``lead``: the number of position dims of ``out`` (its dims before the features)."""
        span, replicated, features = None, True, 0
        if is_dtensor(out):
            i = _dim(out, self.dim_name)
            p = out.placements[i] if i is not None else None
            if p is not None and p.is_shard():
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                d = p.dim if p.dim >= 0 else p.dim + out.dim()
                shape, offset = compute_local_shape_and_global_offset(out.shape, out.device_mesh, out.placements)
                if d < lead:  # positions split: this rank's slice of the lead dim
                    span = Span(d, int(offset[d]), int(shape[d]))
                features = int(offset[-1])
                replicated = False
            elif p is not None and not p.is_replicate():
                replicated = False  # Partial: the parameters split it (a row-parallel weight)
        if replicated and any(_sharded(q, self.dim_name) for q in module.parameters(recurse=False)):
            replicated = False
        return ShardView(local(x), local(out), 1.0 / self.size if replicated else 1.0, span, features)


def _dim(t: Any, name: str) -> int | None:
    names = getattr(t.device_mesh, "mesh_dim_names", None) or ()
    return names.index(name) if name in names else None


def _sharded(param: torch.Tensor, name: str) -> bool:
    """Whether ``param`` is split along the tensor-parallel dim: a DTensor ``Shard`` on the mesh dim ``name``,
    or a plain tensor Megatron marks as partitioned (``tensor_model_parallel``)."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if not is_dtensor(param):
        return False
    i = _dim(param, name)
    return i is not None and param.placements[i].is_shard()


def row_bias_factor(weight: torch.Tensor, bias: torch.Tensor | None) -> float:
    """1/n for the bias of a row-parallel linear (weight split by input features along a mesh dim of n
    ranks, bias replicated there: added once, after the reduction, its gradient whole on every rank)."""
    if bias is None or not is_dtensor(weight) or not is_dtensor(bias):
        return 1.0
    f = 1.0
    for i, p in enumerate(weight.placements):
        if p.is_shard() and p.dim in (1, -1) and bias.placements[i].is_replicate():
            f /= weight.device_mesh.size(i)
    return f


__all__ = ["ShardView", "Span", "TPContext", "is_dtensor", "local", "row_bias_factor"]


def redistributes_inside(module: nn.Module) -> bool:
    """A module that redistributes its inputs and outputs inside its own forward (torchtitan 0.3's
    ``Module`` with a sharding config: ``forward_with_redistribution`` calls ``_redistribute_inputs`` and
    ``_redistribute_outputs``), so its forward hooks see the inputs before and the output after them."""
    return "forward" in vars(module) and getattr(module, "_sharding_config", None) is not None \
        and callable(getattr(module, "_redistribute_outputs", None))


class InnerSite:
    """Capture a :func:`redistributes_inside` module's call between its two redistributions: ``on_call(args,
    raw_output)`` sees the inputs its forward computes on and the output it produced (a DTensor whose
    gradient is what the parameters' gradient is made of), as TP styles' hooks let a prepended forward hook
    see. Installed as instance attributes over the two methods; ``remove`` restores the class's."""

    def __init__(self, module: nn.Module, on_call: Any) -> None:
        self.module = module
        inputs, outputs = module._redistribute_inputs, module._redistribute_outputs
        seen: list[tuple] = []

        def redistribute_inputs(parallel_dims: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            args, kwargs = inputs(parallel_dims, args, kwargs)
            first = args[0] if args else next(iter(kwargs.values()), None)
            seen[:] = [(first,)]
            return args, kwargs

        def redistribute_outputs(parallel_dims: Any, out: Any) -> Any:
            if seen:
                on_call(seen.pop(), out)
            return outputs(parallel_dims, out)

        module._redistribute_inputs = redistribute_inputs
        module._redistribute_outputs = redistribute_outputs

    def remove(self) -> None:
        for name in ("_redistribute_inputs", "_redistribute_outputs"):
            vars(self.module).pop(name, None)
