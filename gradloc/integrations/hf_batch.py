"""Hugging Face batches -> gradloc's per-position view, and the label masking a probe needs.

Pure torch (no transformers import). The layout is the logits' (B, T): a causal LM scores the
logits at position p against ``labels[p + 1]`` (the model shifts inside its loss), so position p's
token id is ``labels[:, p + 1]`` and the last position carries no loss term. A collator that gives
``shift_labels`` (padding-free collators do) has already done that shift.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

IGNORE = -100  # the ignore_index of every Hugging Face loss


@dataclass(frozen=True)
class CausalView:
    token_ids: torch.Tensor  # (B, T) the id each logits position is scored against (text where unscored)
    loss_mask: torch.Tensor  # (B, T) bool: positions with a loss term


def targets(inputs: Mapping[str, Any]) -> torch.Tensor | None:
    """(B, T) targets aligned with the logits, IGNORE where unscored; None if the batch has no
    2-D integer ``shift_labels`` / ``labels``."""
    shift = inputs.get("shift_labels")
    if _int_2d(shift):
        return shift
    labels = inputs.get("labels")
    if not _int_2d(labels):
        return None
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)  # (B, T - 1) -> (B, T): position p scores labels[p + 1]


def causal_view(inputs: Mapping[str, Any], pad_id: int = 0) -> CausalView | None:
    tgt = targets(inputs)
    if tgt is None:
        return None
    mask = tgt != IGNORE
    ids = inputs.get("input_ids")
    if _int_2d(ids) and ids.shape == tgt.shape:
        shown = F.pad(ids[:, 1:], (0, 1), value=pad_id)  # (B, T): the next input token, for the context text
    else:
        shown = torch.full_like(tgt, pad_id)
    return CausalView(torch.where(mask, tgt, shown), mask)


def causal_lm_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token loss terms of a Hugging Face causal LM's default loss (cross-entropy of the logits at
    position p against ``labels[p + 1]``, a mean over the scored labels, in float32): their sum is
    ``model(..., labels=labels).loss`` up to summation order; zero where unscored. A loop integration's
    probe hook (``gradloc_token_loss``) for an HF model."""
    tgt = targets({"labels": labels})
    if tgt is None or logits.dim() != 3 or logits.shape[:2] != tgt.shape:
        raise ValueError(f"logits (B, T, V) and 2-D integer labels (B, T) expected, got {tuple(logits.shape)} and "
                         f"{tuple(getattr(labels, 'shape', ()))}")
    terms = F.cross_entropy(logits.float().transpose(1, 2), tgt, ignore_index=IGNORE, reduction="none")  # (B, V, T) -> (B, T)
    return terms / (tgt != IGNORE).sum().clamp(min=1)


def mask_labels(inputs: Mapping[str, Any], token_mask: torch.Tensor) -> tuple[dict[str, Any], int, int]:
    """A copy of ``inputs`` whose loss keeps only the positions in ``token_mask`` (B, T logits
    layout), with (kept, total) counts of scored positions. Dropping a label (IGNORE) removes its
    term from a token-sum loss exactly; a per-batch mean needs the caller's kept/total rescale."""
    tgt = targets(inputs)
    if tgt is None:
        raise ValueError("the micro-batch has no 2-D labels to mask")
    keep = token_mask.to(device=tgt.device, dtype=torch.bool)
    scored = tgt != IGNORE
    out = dict(inputs)
    if _int_2d(inputs.get("shift_labels")):
        out["shift_labels"] = inputs["shift_labels"].masked_fill(~keep, IGNORE)
    labels = inputs.get("labels")
    if _int_2d(labels) and labels.shape == keep.shape:
        masked = labels.clone()
        masked[:, 1:] = labels[:, 1:].masked_fill(~keep[:, :-1], IGNORE)  # label p+1 <-> logits position p
        out["labels"] = masked
    return out, int((scored & keep).sum()), int(scored.sum())


def pop_sample_ids(inputs: Mapping[str, Any], columns: Sequence[str]) -> tuple[Mapping[str, Any], list[str] | None]:
    """Remove the first present id column from the batch (the model never sees it) and return its
    values as strings (a tensor of ids costs one host transfer per micro-batch)."""
    for col in columns:
        if col in inputs:
            value = inputs[col]
            rest = {k: v for k, v in inputs.items() if k != col}
            if isinstance(value, torch.Tensor):
                value = value.reshape(-1).tolist()  # (B,) or (B, 1) -> B ids
            return rest, [str(v) for v in value]
    return inputs, None


def batch_shape(inputs: Mapping[str, Any]) -> tuple[int, int]:
    """(B, T) of the micro-batch's ``input_ids`` (or first 2-D tensor), else (B, 1)."""
    tensors = [inputs.get("input_ids")] + list(inputs.values())
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            return int(t.shape[0]), int(t.shape[1])
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[0]), 1
    return 1, 1


def _int_2d(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 2 and not x.dtype.is_floating_point and x.dtype != torch.bool
