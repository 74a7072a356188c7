"""Jagged (nested) tensors and tensordict values, duck-typed: what the framework helpers share.

verl keeps per-sequence tensors as ``torch.nested`` jagged tensors (``values()`` (N, …) back to back,
``offsets()`` (B + 1,)) and scalars as tensordict ``NonTensorData``; none of it is imported here.
"""
from __future__ import annotations

from typing import Any

import torch

from gradloc.errors import BatchMetadataError


def where_values(t: Any, keep: torch.Tensor, detach_outside: bool) -> Any:
    """``t`` (nested over the sequences, or dense) with its N values outside ``keep`` (N,) detached
    (same value, no gradient) or zeroed."""
    v = values_of(t)
    if v.numel() != keep.numel():
        raise BatchMetadataError(f"the model output has {v.numel()} values, the micro-batch {keep.numel()} positions")
    k = keep.to(v.device).view(v.shape)
    nv = torch.where(k, v, v.detach() if detach_outside else torch.zeros_like(v))
    return nest(nv, t.offsets()) if getattr(t, "is_nested", False) else nv


def nest(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A jagged nested tensor with its sequence-length bounds set (without them ``to_padded_tensor``,
    which tensordict's uses, pads every row to the total length)."""
    lens = offsets.diff()
    return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=int(lens.min()), max_seqlen=int(lens.max()))


def values_of(t: Any) -> torch.Tensor:
    return t.values() if getattr(t, "is_nested", False) else t


def to_rows(v: torch.Tensor, lens: torch.Tensor, fill: float) -> torch.Tensor:
    """(N,) values of sequences back to back → (B, L) right-padded rows with ``fill``."""
    B, L = lens.numel(), int(lens.max()) if lens.numel() else 0
    out = torch.full((B, L), fill, dtype=v.dtype, device=v.device)
    out[(torch.arange(L)[None] < lens[:, None]).to(v.device)] = v  # row by row, in order
    return out


def non_tensor(v: Any) -> Any:
    """tensordict's NonTensorData / NonTensorStack, numpy arrays → their Python value (``tu.get`` does the same)."""
    name = type(v).__name__
    if name == "NonTensorData":
        return non_tensor(v.data)
    if name == "NonTensorStack" or (name == "ndarray" and hasattr(v, "tolist")):
        return v.tolist()
    return v


def describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor {tuple(x.shape)}" + (" (nested)" if x.is_nested else "")
    return type(x).__name__


def micro_batch_kwargs(batch: Any) -> dict[str, Any]:
    """``mon.micro_batch(**...)`` arguments of a framework batch (verl's or OpenRLHF's layout): ids, loss
    mask, sample ids and infos, and ``cu_seqlens`` when the rows are packed."""
    kw = {"token_ids": batch.token_ids, "loss_mask": batch.loss_mask, "sample_ids": batch.sample_ids,
          "sample_infos": batch.infos}
    if batch.packed:
        kw["cu_seqlens"] = batch.cu_seqlens
    return kw
