"""Per-micro-batch metadata the user hands in, validated when the micro-batch block opens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from gradloc.errors import BatchMetadataError


@dataclass(frozen=True)
class RngState:
    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] | None

    @staticmethod
    def capture() -> "RngState":
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None
        return RngState(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(list(self.cuda))


@dataclass(frozen=True)
class MicroBatchMeta:
    index: int
    batch: int
    seq: int
    token_ids: torch.Tensor | None  # (B, T) ids aligned with loss positions (causal LM: the labels)
    loss_mask: torch.Tensor | None  # (B, T) bool; positions with no loss term cannot be culprits
    sample_ids: tuple[str, ...] | None
    rng: RngState  # RNG at block entry, so a probe replays the same dropout masks


def make_meta(index: int, token_ids: torch.Tensor | None, loss_mask: torch.Tensor | None,
              sample_ids: Sequence[object] | None, shape: tuple[int, int] | None) -> MicroBatchMeta:
    """Validate and snapshot one micro-batch's metadata; raises :class:`BatchMetadataError`."""
    if token_ids is not None:
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 2:
            raise BatchMetadataError(f"token_ids must be a 2-D (batch, seq) tensor, got {_desc(token_ids)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
            raise BatchMetadataError(f"token_ids must be an integer tensor, got dtype {token_ids.dtype}")
        shape = (int(token_ids.shape[0]), int(token_ids.shape[1]))
    if shape is None:
        raise BatchMetadataError("give token_ids (B, T) or shape=(B, T) for the micro-batch")
    B, T = shape
    if loss_mask is not None:
        if not isinstance(loss_mask, torch.Tensor) or tuple(loss_mask.shape) != (B, T):
            raise BatchMetadataError(f"loss_mask must have shape {(B, T)} like the micro-batch, got {_desc(loss_mask)}")
        loss_mask = loss_mask.detach().to(torch.bool).clone()
    ids = None if sample_ids is None else tuple(str(s) for s in sample_ids)
    if ids is not None and len(ids) != B:
        raise BatchMetadataError(f"sample_ids has {len(ids)} entries for a micro-batch of {B} samples")
    tok = None if token_ids is None else token_ids.detach().clone()
    return MicroBatchMeta(index, B, T, tok, loss_mask, ids, RngState.capture())


def _desc(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
