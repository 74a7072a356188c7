"""What the per-sample judgement reads off the loss head's output gradient, in backward (collector/surprise.py).

For a cross-entropy head, g_p = w·(softmax_p − onehot(y_p)) at position p. Three reads, all on the device:

- u_p = −g_p[y_p] = w·(1 − p_p(y_p)): how surprised the model was by its own label (``head_u``);
- ‖g_p‖²: with u_p it gives the model's own confidence Σ_v p_v² (``head_g2``; the head rule's reduction, shared);
- a_p(k) = g_{p+k}[y_p] for the offsets k = ±1 … ±K (``head_shift``, (2K, B, T); 0 where p + k leaves the row):
  how likely the model found p's label at a *neighbouring* position. Since p_{p+k}(y_p) = a_p(k)/w + [y_p = y_{p+k}],
  a sample whose labels are its text shifted by k (an off-by-one in a data pipeline, labels that are the inputs)
  is one whose labels the model predicts far better k positions away than where they stand: each sample is its
  own reference, whatever the kind of text (surprise.py judges it). 2K gathers of B×T values per step.

Under tensor parallelism ``columns`` is the first vocabulary column of this rank's shard (the ranks' u and a add
up to the whole), or ``factor`` is 1/tp where every rank holds every column.
"""
from __future__ import annotations

import torch

from gradloc.collector.scores_buffer import MicroBatchScores


def read_head(buf: MicroBatchScores, g: torch.Tensor, g2: torch.Tensor, columns: int = 0, factor: float = 1.0) -> None:
    """Keep the head's reads of one micro-batch in ``buf`` (its labels set): ``g`` the head's output gradient
    (*lead, V') batch-first, ``g2`` its ``sq_norm_last`` (lead)."""
    buf.head_u = head_u(g, buf.labels, buf.batch, buf.seq, columns, factor)
    buf.head_g2 = head_g2(g2, buf.batch, buf.seq, factor)
    buf.head_shift = head_shift(g, buf.labels, buf.batch, buf.seq, buf.shifts, columns, factor) \
        if buf.shifts else None


def head_g2(g2: torch.Tensor, batch: int, seq: int, factor: float = 1.0) -> torch.Tensor:
    """‖g_p‖² (B, T) float32 over the head's columns from ``g2`` = ``sq_norm_last`` of its output gradient (a
    vocabulary shard's part: the tp ranks' parts add up; ``factor`` 1/tp where every rank holds them all). The
    same reduction is the head rule's ‖g_p‖² (``reusing_sq_norm``): the vocabulary is reduced once per position."""
    n2 = g2.reshape(batch, seq)  # lead -> (B, T)
    return n2 * factor if factor != 1.0 else n2


def _labels(g: torch.Tensor, labels: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's column of each label, clamped into it (lead), and where it really is one (lead, bool)."""
    V = g.shape[-1]
    lab = labels.to(g.device, non_blocking=True).reshape(g.shape[:-1]) - columns  # (B, T) -> lead
    return lab.clamp(0, V - 1), (lab >= 0) & (lab < V)


def head_u(g: torch.Tensor, labels: torch.Tensor, batch: int, seq: int, columns: int = 0,
           factor: float = 1.0) -> torch.Tensor:
    """u_p = −g_p[label_p] (B, T) float32; 0 where the label is not a column of g (e.g. −100)."""
    lab, ok = _labels(g, labels, columns)
    u = -g.gather(-1, lab.unsqueeze(-1)).squeeze(-1).float()  # (*lead, 1) -> lead
    u = torch.where(ok, u, 0.0).reshape(batch, seq)  # lead -> (B, T)
    return u * factor if factor != 1.0 else u


def head_shift(g: torch.Tensor, labels: torch.Tensor, batch: int, seq: int, shifts: int, columns: int = 0,
               factor: float = 1.0) -> torch.Tensor:
    """a_p(k) = g_{p+k}[label_p] (2K, B, T) float32 for k = −K … −1, 1 … K (``offsets``); 0 where p + k is outside
    the row or the label is not a column of g."""
    lab, ok = _labels(g, labels, columns)
    gb = g.reshape(batch, seq, g.shape[-1])  # lead -> (B, T, V')
    lab, ok = lab.reshape(batch, seq), ok.reshape(batch, seq)  # lead -> (B, T)
    out = torch.zeros(2 * shifts, batch, seq, dtype=torch.float32, device=g.device)
    for i, k in enumerate(offsets(shifts)):
        if abs(k) >= seq:
            continue
        if k > 0:  # p in [0, T − k): g at p + k
            got = gb[:, k:].gather(-1, lab[:, :seq - k].unsqueeze(-1)).squeeze(-1)  # (B, T − k, 1) -> (B, T − k)
            out[i, :, :seq - k] = torch.where(ok[:, :seq - k], got.float(), 0.0)
        else:  # p in [−k, T): g at p + k
            got = gb[:, :seq + k].gather(-1, lab[:, -k:].unsqueeze(-1)).squeeze(-1)  # (B, T + k, 1) -> (B, T + k)
            out[i, :, -k:] = torch.where(ok[:, -k:], got.float(), 0.0)
    return out * factor if factor != 1.0 else out


def offsets(shifts: int) -> tuple[int, ...]:
    """The offsets k of ``head_shift``'s rows, in order."""
    return tuple(range(-shifts, 0)) + tuple(range(1, shifts + 1))
