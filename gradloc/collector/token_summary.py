"""Reduce a step's micro-batch score buffers on the device; unpack the host copy into records."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gradloc.collector.batch import MicroBatchMeta
from gradloc.collector.packs import Pack
from gradloc.collector.scores_buffer import MicroBatchScores
from gradloc.records import LayerShare, TokenScore, TokenStats


@dataclass(frozen=True)
class StepScores:
    """Device tensors of one step's scores (kept until the step is done, fetched on a spike)."""

    metas: tuple[MicroBatchMeta, ...]
    totals: torch.Tensor  # (N,) Σ over layers, raw (GradScaler-scaled²)
    exact: torch.Tensor  # (N,) the position-exact layer's score (candidates are ranked by it)
    per_layer: torch.Tensor | None  # (L, N), or None without the per-layer breakdown
    eligible: torch.Tensor  # (N,) bool
    dropped_calls: int
    dropped_layers: frozenset[int]
    unscored_modules: frozenset[str]  # watched but not scored this step: their ‖g‖² is unattributed
    exact_layer: int | None  # last watched layer in forward order (the LM head): position-exact
    # a token group's checks (parallel/tokens.py), read with the step's host transfer; None alone
    check: torch.Tensor | None = None
    # the loss head's u_p (collector/surprise.py) when samples are judged: (N,) float32, 0 where a micro-batch has
    # none, and per micro-batch how many ranks gave it (M,) float32 (a token group's head shards add up)
    head_u: torch.Tensor | None = None
    head_has: torch.Tensor | None = None
    head_g2: torch.Tensor | None = None  # (N,) float32 ‖g_p‖² at the head, 0 where head_u is 0, NaN where not read
    head_shift: torch.Tensor | None = None  # (2K, N) float32 g_{p+k}[y_p] (collector/head_read.py), 0 where not read
    head_given: bool = False  # this rank read some micro-batch's u_p (known on the host: no sync to ask)
    # Megatron sequence parallelism: per linear (slot) its two factors (K, 2, N), their layers (K,), and the
    # linears' names; the token group sums them and forms the products (parallel/tokens.py: combine)
    pairs: torch.Tensor | None = None
    pair_layers: tuple[int, ...] = ()
    pair_names: frozenset[str] = frozenset()

    @property
    def offsets(self) -> tuple[int, ...]:
        out = [0]
        for m in self.metas:
            out.append(out[-1] + m.n_tokens)
        return tuple(out)


def head_rows(parts: Sequence[tuple[MicroBatchMeta, MicroBatchScores | None]], device: torch.device,
              shifts: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(u (N,) float32, 0 where a micro-batch has no head u_p; has (M,) float32, 1 where it has; ‖g‖² (N,)
    float32, 0 where u is, NaN where u was read without it; the neighbour reads (2K, N) float32, 0 where a
    micro-batch gave none, or None without ``shifts``: the same size on every rank of a token group)."""
    u = [buf.head_u.reshape(-1).float().to(device) if buf is not None and buf.head_u is not None  # (B, T) -> (B·T,)
         else torch.zeros(m.n_tokens, device=device) for m, buf in parts]
    has = [buf is not None and buf.head_u is not None for _, buf in parts]
    g2 = [torch.zeros(m.n_tokens, device=device) if buf is None or buf.head_u is None
          else torch.full((m.n_tokens,), float("nan"), device=device) if buf.head_g2 is None
          else buf.head_g2.reshape(-1).float().to(device) for m, buf in parts]  # (B, T) -> (B·T,)
    rows = 2 * shifts
    shift = torch.cat([buf.head_shift.reshape(rows, -1).to(device)  # (2K, B, T) -> (2K, B·T)
                       if buf is not None and buf.head_shift is not None and buf.head_shift.shape[0] == rows
                       else torch.zeros(rows, m.n_tokens, device=device) for m, buf in parts], dim=1) if rows else None
    return torch.cat(u), torch.tensor(has, dtype=torch.float32, device=device), torch.cat(g2), shift


def pair_rows(parts: Sequence[tuple[MicroBatchMeta, MicroBatchScores | None]], slots: int,
              device: torch.device) -> tuple[torch.Tensor, tuple[int, ...], frozenset[str]]:
    """The step's sequence-parallel factors (K, 2, N), zero where a micro-batch gave none; each slot's layer (-1:
    never called this step) and the linears' names."""
    rows, layers, names = [], [-1] * slots, set()
    for meta, buf in parts:
        n = meta.n_tokens
        got = buf.pairs if buf is not None else {}
        rows.append(torch.stack([got[k].reshape(2, n).to(device) if k in got  # (2, B, T) -> (2, B·T)
                                 else torch.zeros(2, n, device=device) for k in range(slots)]) if slots
                    else torch.zeros(0, 2, n, device=device))
        if buf is not None:
            for k, layer in buf.pair_layers.items():
                layers[k] = layer
            names |= set(buf.pair_names.values())
    return torch.cat(rows, dim=2), tuple(layers), frozenset(names)


def stack_step(parts: Sequence[tuple[MicroBatchMeta, MicroBatchScores | None]], n_layers: int,
               device: torch.device, watched: frozenset[str] = frozenset(), heads: bool = False,
               pair_slots: int = 0, shifts: int = 0) -> StepScores:
    """The step's scores. ``watched``: every module with a per-token rule. One that no micro-batch
    scored — its calls could not be split per token, its hook failed, or its weight was used
    without calling it (a fused LM head) — contributed nothing to the scores, so its gradient is
    the step's unattributed share (a module without a gradient adds nothing there). ``heads``: carry
    the loss head's u_p (per-sample surprise is judged), with its reads at ``shifts`` neighbours each side."""
    breakdown = all(buf is None or buf.breakdown for _, buf in parts)
    totals, exacts, layers, eligible = [], [], [], []
    dropped, dropped_layers, exact_layer = 0, set(), None
    called: set[str] = set()
    scored: set[str] = set()
    for meta, buf in parts:
        n = meta.n_tokens
        zeros = torch.zeros(n, device=device)
        if buf is not None and buf.scores is not None:
            tot, ex, per = buf.rows()
            totals.append(tot.reshape(n).to(device))  # (B, T) -> (B·T,)
            exacts.append(zeros if ex is None else ex.reshape(n).to(device))  # (B, T) -> (B·T,)
            if breakdown:
                layers.append(per.reshape(n_layers, n).to(device))  # (L, B, T) -> (L, B·T)
        else:
            totals.append(zeros)
            exacts.append(zeros)
            if breakdown:
                layers.append(torch.zeros(n_layers, n, device=device))
        if buf is not None:
            dropped += buf.dropped_calls + buf.hook_errors
            dropped_layers |= buf.dropped_layers
            called |= buf.matched_modules | buf.lost_modules
            scored |= buf.scored_modules
            exact_layer = buf.last_layer if exact_layer is None else exact_layer
        if meta.loss_mask is None:
            eligible.append(torch.ones(n, dtype=torch.bool, device=device))
        else:
            eligible.append(meta.loss_mask.reshape(n).to(device, non_blocking=True))  # (B, T) -> (B·T,)
    u, has, g2, shift = head_rows(parts, device, shifts) if heads else (None, None, None, None)
    pairs, pair_layers, pair_names = pair_rows(parts, pair_slots, device) if pair_slots else (None, (), frozenset())
    return StepScores(tuple(m for m, _ in parts), torch.cat(totals), torch.cat(exacts),
                      torch.cat(layers, dim=1) if breakdown else None, torch.cat(eligible), dropped,
                      frozenset(dropped_layers), frozenset((called | watched) - scored), exact_layer,
                      head_u=u, head_has=has, head_g2=g2, head_shift=shift, head_given=heads and any(b is not None and b.head_u is not None
                                                                       for _, b in parts),
                      pairs=pairs, pair_layers=pair_layers, pair_names=pair_names)


def summary_layout(s: StepScores, k: int, n_layers: int) -> Pack:
    """The step's token summary: micro-batch sums (M), the top-k tokens' scores, flat indices and token ids (-1
    where a micro-batch gave none), their per-layer breakdown (L·k, none without per-layer rows), the total."""
    k = min(k, int(s.totals.numel()))
    return Pack.of(mb_sums=len(s.metas), top_vals=k, top_idx=k, top_ids=k,
                   breakdown=n_layers * k if s.per_layer is not None else 0, total=1)


def summary_pack(s: StepScores, k: int) -> torch.Tensor:
    """The :func:`summary_layout` vector (float64, on the device)."""
    masked = torch.where(s.eligible, s.totals, torch.zeros_like(s.totals))
    k = min(k, masked.numel())
    vals, idx = torch.topk(masked, k)
    offs = s.offsets
    ids = torch.cat([m.token_ids.reshape(-1).to(masked.device) if m.token_ids is not None  # (B, T) -> (B·T,)
                     else torch.full((m.n_tokens,), -1, device=masked.device) for m in s.metas])
    layout = summary_layout(s, k, s.per_layer.shape[0] if s.per_layer is not None else 0)
    return layout.build(mb_sums=torch.stack([s.totals[a:b].sum() for a, b in zip(offs, offs[1:])]).double(),
                        top_vals=vals.double(), top_idx=idx.double(), top_ids=ids[idx].double(),
                        breakdown=(s.per_layer[:, idx].flatten() if s.per_layer is not None  # (L, k) -> (L·k,)
                                   else vals.new_zeros(0)).double(), total=s.totals.sum().double())


def unpack_summary(host: np.ndarray, s: StepScores, k: int, layers: Sequence[str], scale_sq: float,
                   unattributed_share: float) -> TokenStats:
    L = len(layers) if s.per_layer is not None else 0
    k = min(k, int(s.totals.numel()))
    layout = summary_layout(s, k, L)
    mb = layout.get(host, "mb_sums") * scale_sq
    vals, idx = layout.get(host, "top_vals") * scale_sq, layout.get(host, "top_idx").astype(np.int64)
    tok_ids = layout.get(host, "top_ids").astype(np.int64)
    breakdown = layout.get(host, "breakdown").reshape(L, k) * scale_sq  # (L·k,) -> (L, k)
    total = layout.scalar(host, "total") * scale_sq
    offs = np.asarray(s.offsets)
    top = []
    for j in range(k):
        if not vals[j] > 0:
            continue
        m = int(np.searchsorted(offs, idx[j], side="right")) - 1
        meta, local = s.metas[m], int(idx[j] - offs[m])
        b, t = meta.locate(local)
        col = breakdown[:, j]
        lshares = tuple(LayerShare(layers[i], float(col[i] / vals[j])) for i in np.argsort(-col)[:5] if col[i] > 0)
        top.append(TokenScore(micro_batch=meta.index, sample=b, position=t, score=float(vals[j]),
                              share=float(vals[j] / total) if total > 0 else 0.0,
                              token_id=int(tok_ids[j]) if tok_ids[j] >= 0 else None,
                              sample_id=meta.sample_id(b), layers=lshares))
    mb_shares = tuple(float(x / total) if total > 0 else 0.0 for x in mb)
    return TokenStats(tokens=int(s.totals.numel()), total_score=total, top=tuple(top),
                      top_share=top[0].share if top else 0.0, micro_batch_shares=mb_shares,
                      unattributed_share=unattributed_share, dropped_calls=s.dropped_calls)
