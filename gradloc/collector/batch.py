"""Per-micro-batch metadata the user hands in, validated when the micro-batch block opens.

Two layouts, one mapping. A padded micro-batch is (B, T): sample b is row b. A packed micro-batch
is (1, N) with several sequences back to back (verl's remove-padding mode, document-packed
pre-training), their boundaries given as ``cu_seqlens`` (S + 1 offsets, 0 … N) or as position ids
that restart at 0. Either way a position is a flat index into the micro-batch's B·T positions,
and :meth:`MicroBatchMeta.locate` turns it into (sample, position within that sample): culprits
are reported per sample, and their context never crosses into the neighbouring sequence.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch

from gradloc.errors import BatchMetadataError
from gradloc.records import SampleInfo


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
    sample_ids: tuple[str, ...] | None  # one per sample (per sequence when packed)
    rng: RngState  # RNG at block entry, so a probe replays the same dropout masks
    starts: tuple[int, ...] | None = None  # packed (1, N): flat start of each sequence; None: one per row
    sample_infos: tuple[SampleInfo, ...] | None = None  # one per sample: where it came from (RL rollouts)

    @property
    def n_tokens(self) -> int:
        return self.batch * self.seq

    @property
    def n_samples(self) -> int:
        return len(self.starts) if self.starts is not None else self.batch

    @property
    def packed(self) -> bool:
        return self.starts is not None

    def bounds(self, sample: int) -> tuple[int, int]:
        """Flat [start, end) of one sample."""
        if self.starts is None:
            return sample * self.seq, (sample + 1) * self.seq
        end = self.starts[sample + 1] if sample + 1 < len(self.starts) else self.n_tokens
        return self.starts[sample], end

    def locate(self, flat: int) -> tuple[int, int]:
        """Flat index within the micro-batch → (sample, position within the sample)."""
        if self.starts is None:
            return divmod(flat, self.seq)
        s = bisect.bisect_right(self.starts, flat) - 1
        return s, flat - self.starts[s]

    def flat(self, sample: int, position: int) -> int:
        return self.bounds(sample)[0] + position

    def sample_id(self, sample: int) -> str | None:
        return self.sample_ids[sample] if self.sample_ids else None

    def sample_info(self, sample: int) -> SampleInfo | None:
        return self.sample_infos[sample] if self.sample_infos else None

    def sample_tokens(self, sample: int) -> list[int]:
        """Token ids of one sample's positions ([] without token ids)."""
        if self.token_ids is None:
            return []
        a, b = self.bounds(sample)
        return [int(x) for x in self.token_ids.reshape(-1)[a:b].tolist()]  # (B, T) -> (B·T,)


def make_meta(index: int, token_ids: torch.Tensor | None, loss_mask: torch.Tensor | None,
              sample_ids: Sequence[object] | None, shape: tuple[int, int] | None,
              cu_seqlens: Sequence[int] | torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None,
              sample_infos: Sequence[SampleInfo] | None = None) -> MicroBatchMeta:
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
    starts = _packed_starts(B, T, cu_seqlens, position_ids)
    n_samples = len(starts) if starts is not None else B
    ids = None if sample_ids is None else tuple(str(s) for s in sample_ids)
    if ids is not None and len(ids) != n_samples:
        what = "sequences in the packed row" if starts is not None else "samples"
        raise BatchMetadataError(f"sample_ids has {len(ids)} entries for a micro-batch of {n_samples} {what}")
    infos = None if sample_infos is None else tuple(sample_infos)
    if infos is not None and (len(infos) != n_samples or not all(isinstance(x, SampleInfo) for x in infos)):
        raise BatchMetadataError(f"sample_infos must hold one gradloc.SampleInfo per sample ({n_samples}), "
                                 f"got {len(infos)} item(s)")
    tok = None if token_ids is None else token_ids.detach().clone()
    return MicroBatchMeta(index, B, T, tok, loss_mask, ids, RngState.capture(), starts, infos)


def _packed_starts(B: int, T: int, cu_seqlens: Sequence[int] | torch.Tensor | None,
                   position_ids: torch.Tensor | None) -> tuple[int, ...] | None:
    """Sequence starts of a packed (1, N) micro-batch, from cu_seqlens or restarting position ids."""
    if cu_seqlens is None and position_ids is None:
        return None
    if B != 1:
        raise BatchMetadataError(f"a packed micro-batch is one row (1, N) of sequences back to back, got ({B}, {T})")
    if cu_seqlens is not None:
        cu = _int_list(cu_seqlens, "cu_seqlens")
        if len(cu) < 2 or cu[0] != 0:
            raise BatchMetadataError(f"cu_seqlens must start at 0 and hold S + 1 offsets, got {cu[:8]}")
        if any(b <= a for a, b in zip(cu, cu[1:])):
            raise BatchMetadataError(f"cu_seqlens must be strictly increasing (no empty sequence), got {cu[:8]}…")
        if cu[-1] != T:
            raise BatchMetadataError(f"packed boundaries add up to {cu[-1]} positions, but the row has N = {T}")
        return tuple(cu[:-1])
    pos = _int_list(position_ids, "position_ids")
    if len(pos) != T:
        raise BatchMetadataError(f"position_ids has {len(pos)} entries for a packed row of N = {T}")
    if pos[0] != 0:
        raise BatchMetadataError(f"position_ids of a packed row must start at 0, got {pos[0]}")
    return tuple(i for i, p in enumerate(pos) if p == 0)


def _int_list(x: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    """A host list of ints (one small transfer if ``x`` lives on a device; pass a CPU copy to avoid it)."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise BatchMetadataError(f"{name} must hold integers, got dtype {x.dtype}")
        return [int(v) for v in x.reshape(-1).tolist()]  # (…) -> (n,)
    try:
        return [int(v) for v in x]
    except (TypeError, ValueError) as exc:
        raise BatchMetadataError(f"{name} must be a sequence of integers: {exc}") from exc


def _desc(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
