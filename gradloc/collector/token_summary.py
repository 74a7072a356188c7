"""Reduce a step's micro-batch score buffers on the device; unpack the host copy into records."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gradloc.collector.batch import MicroBatchMeta
from gradloc.collector.token_hooks import MicroBatchScores
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

    @property
    def offsets(self) -> tuple[int, ...]:
        out = [0]
        for m in self.metas:
            out.append(out[-1] + m.n_tokens)
        return tuple(out)


def stack_step(parts: Sequence[tuple[MicroBatchMeta, MicroBatchScores | None]], n_layers: int,
               device: torch.device, watched: frozenset[str] = frozenset()) -> StepScores:
    """The step's scores. ``watched``: every module with a per-token rule. One that no micro-batch
    scored — its calls could not be split per token, its hook failed, or its weight was used
    without calling it (a fused LM head) — contributed nothing to the scores, so its gradient is
    the step's unattributed share (a module without a gradient adds nothing there)."""
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
    return StepScores(tuple(m for m, _ in parts), torch.cat(totals), torch.cat(exacts),
                      torch.cat(layers, dim=1) if breakdown else None, torch.cat(eligible), dropped,
                      frozenset(dropped_layers), frozenset((called | watched) - scored), exact_layer)


def summary_pack(s: StepScores, k: int) -> torch.Tensor:
    """``[mb_sums(M) | top_vals(k) | top_idx(k) | top_token_ids(k) | breakdown(L·k)? | total]``
    (float64; token ids are -1 where a micro-batch gave none; no breakdown without per-layer rows)."""
    masked = torch.where(s.eligible, s.totals, torch.zeros_like(s.totals))
    k = min(k, masked.numel())
    vals, idx = torch.topk(masked, k)
    offs = s.offsets
    mb_sums = torch.stack([s.totals[a:b].sum() for a, b in zip(offs, offs[1:])])
    ids = torch.cat([m.token_ids.reshape(-1).to(masked.device) if m.token_ids is not None  # (B, T) -> (B·T,)
                     else torch.full((m.n_tokens,), -1, device=masked.device) for m in s.metas])
    breakdown = [s.per_layer[:, idx].flatten()] if s.per_layer is not None else []  # (L, k) -> (L·k,)
    parts = [mb_sums, vals, idx.to(vals.dtype), ids[idx].to(vals.dtype), *breakdown, s.totals.sum()[None]]
    return torch.cat([p.double() for p in parts])


def summary_length(s: StepScores, k: int, n_layers: int) -> int:
    k = min(k, int(s.totals.numel()))
    return len(s.metas) + 3 * k + (n_layers * k if s.per_layer is not None else 0) + 1


def unpack_summary(host: np.ndarray, s: StepScores, k: int, layers: Sequence[str], scale_sq: float,
                   unattributed_share: float) -> TokenStats:
    M, L = len(s.metas), len(layers) if s.per_layer is not None else 0
    k = min(k, int(s.totals.numel()))
    mb = host[:M] * scale_sq
    vals, idx = host[M:M + k] * scale_sq, host[M + k:M + 2 * k].astype(np.int64)
    tok_ids = host[M + 2 * k:M + 3 * k].astype(np.int64)
    breakdown = host[M + 3 * k:M + 3 * k + L * k].reshape(L, k) * scale_sq  # (L·k,) -> (L, k)
    total = float(host[M + 3 * k + L * k]) * scale_sq
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
