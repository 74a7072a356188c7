"""The precursor statistics of one module call, on the device, under ``no_grad`` (records/precursors.py says what
each is). Every function returns device tensors and never syncs with the host: the values ride the step's one host
transfer (collector/precursors/slots.py): nothing here reads a value on the host or sizes a tensor by one
(``bincount``, ``unique``, ``nonzero`` would). Locations are (row, position) of the micro-batch."""
from __future__ import annotations

import math

import torch

from gradloc.collector.shards import is_dtensor


def _unravel(flat: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """The multi-index of a flat index into ``shape`` (device tensors, no sync)."""
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat = torch.div(flat, n, rounding_mode="floor")
    return out[::-1]


_ROWS: dict[tuple[int, int, str], torch.Tensor] = {}
_CAUSAL: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # keyed by id(rows): _ROWS keeps them alive
_CAUSAL_KEPT = 64


def causal(rows: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal mask at query ``rows`` over S keys (SDPA's top-left alignment: key j takes part for query i when
    j <= i): (Q, S) float32 additive (0, or −inf where key j comes after the row) and (Q,) float32 how many keys each
    row sees; kept per (rows, S). Added to the logits in place, it costs a fraction of a ``masked_fill`` with a
    broadcast bool mask, and the key counts spare a pass over the logits (BENCHMARKS §1)."""
    key = (id(rows), S)
    hit = None if torch.compiler.is_compiling() else _CAUSAL.get(key)  # traced: part of the graph (no cache
    if hit is None:                                                      # keyed by an object's id)
        after = torch.arange(S, device=rows.device)[None, :] > rows[:, None]  # (Q, S)
        bias = torch.zeros(after.shape, device=rows.device).masked_fill_(after, float("-inf"))  # (Q, S)
        hit = bias, (rows + 1).clamp(max=S).float()  # (Q,)
        if not torch.compiler.is_compiling():
            if len(_CAUSAL) >= _CAUSAL_KEPT:  # sequences of many lengths (dynamic padding): bounded, rebuilt on demand
                _CAUSAL.clear()
            _CAUSAL[key] = hit
    return hit


def query_rows(T: int, queries: int, device: torch.device) -> torch.Tensor:
    """``queries`` query positions of T, evenly spaced, the first and the last among them (all of T when fewer);
    built on the host once per (T, queries, device) and kept: no transfer per call."""
    key = (T, queries, str(device))
    rows = None if torch.compiler.is_compiling() else _ROWS.get(key)  # traced: a constant of the graph, not kept
    if rows is None:
        picked = sorted({round(i * (T - 1) / (queries - 1)) for i in range(queries)}) if 1 < queries < T else \
            list(range(T)) if queries >= T else [T - 1]
        rows = torch.tensor(picked, dtype=torch.long, device=device)
        if not torch.compiler.is_compiling():
            _ROWS[key] = rows
    return rows


def attention_logits(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, attn_mask: torch.Tensor | None,
                     is_causal: bool, scale: float | None) -> torch.Tensor:
    """The logits of scaled-dot-product attention at query ``rows`` only: (B, H, Q, S) float32, −inf where the mask
    keeps a key out. q (B, H, T, D), k (B, Hk, S, D) with H a multiple of Hk (grouped-query attention); the mask
    as SDPA takes it (bool: True takes part; float: added), broadcastable to (B, H, T, S); ``is_causal``: key j
    takes part for query i when j <= i (SDPA's top-left alignment)."""
    H, Hk = q.shape[1], k.shape[1]
    if Hk != H:
        k = k.repeat_interleave(H // Hk, dim=1)  # (B, Hk, S, D) -> (B, H, S, D)
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    # the scale on the Q sampled rows, not on the (Q, S) logits; k made contiguous (a view of a fused projection,
    # as most models make it, would be copied by the matmul in a slower kernel): both a fraction of the call
    rows_q = q.index_select(2, rows).float() * s  # (B, H, T, D) -> (B, H, Q, D)
    logits = rows_q @ k.float().contiguous().transpose(-1, -2)  # (B, H, Q, D) @ (B, H, D, S) -> (B, H, Q, S)
    S = k.shape[2]
    if is_causal:
        logits.add_(causal(rows, S)[0])  # −inf after the row
    if attn_mask is not None:
        m = attn_mask.expand(*attn_mask.shape[:-2], q.shape[2], S)[..., rows, :]  # (.., T, S) -> (.., Q, S)
        logits = logits.masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else logits.add_(m.float())
    return logits


def sampled_attention_stats(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, attn_mask: torch.Tensor | None,
                            is_causal: bool, scale: float | None) -> dict[str, torch.Tensor]:
    """:func:`attention_stats` of an SDPA call at query ``rows`` (:func:`attention_logits`'s arguments); a causal call
    without a mask takes its rows' key counts from :func:`causal`, any other counts them from its −inf logits."""
    keys = causal(rows, k.shape[2])[1] if is_causal and attn_mask is None else None
    return attention_stats(attention_logits(q, k, rows, attn_mask, is_causal, scale), rows, keys)


def attention_stats(logits: torch.Tensor, rows: torch.Tensor | None = None,
                    keys: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per head of one call's attention logits (B, H, Q, S) (−inf: masked; ``rows``: the positions of the Q query
    rows, None: all of them; ``keys``: how many keys each row sees, (Q,) or broadcastable to (B, H, Q), None: the
    keys not −inf, counted): ``max`` (H,) the largest logit, ``max_at`` (2,) the (row, position) of the largest
    over heads, ``entropy_sum`` (H,) the sum of its rows' entropies (nats) and ``rows`` (H,) how many rows counted
    (a row with every key masked does not), ``min_row`` the lowest entropy of a row over its most possible
(log of the keys it sees: rows of at least 2 keys) and ``min_at`` (2,) where."""
    B, H, Q, S = logits.shape
    # Few full passes over the logits, each a vectorized kernel (on a CPU the elementwise exp, entr and xlogy and a
    # flat argmax over the whole tensor ran scalar), and few small ops (each a kernel launch on a GPU; in-step cost:
    # `python -m bench overhead --profile`, BENCHMARKS §1)
    row_max = logits.amax(dim=-1)  # (B, H, Q, S) -> (B, H, Q); −inf on a row with every key masked
    per_head = row_max.amax(dim=(0, 2))  # (B, H, Q) -> (H,)
    i = row_max.flatten().argmax()  # the row holding the largest logit, flat over (B, H, Q)
    # entropy −Σ p·log p = log s − Σ p·y, with y = logit − row max (≤ 0), s = Σ exp(y) and log s = −log p at the max:
    # one softmax kernel (a log-softmax beside it made two; a plain exp ran 2× slower on a CPU over −inf, 30× over
    # denormal results). Both terms are ≥ 0: a collapsed row's small entropy is a sum, not a difference of near-equal
    # values; its floor is float32's rounding of s = 1 + r (~6e-8), as with the log-softmax. A masked key: p 0 and y
    # clamped finite (0 · finite = 0, not 0 · −inf); a row with every key masked: NaN (its max −inf). In float32
    # whatever the weights' dtype (an eager bf16 attention's: a collapsed row's entropy is below bf16's resolution)
    p = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (B, H, Q, S)
    y = (logits.float() - row_max.float().unsqueeze(-1)).clamp_(min=torch.finfo(torch.float32).min)  # (B, H, Q, S)
    ent = -p.amax(dim=-1).log() - torch.linalg.vecdot(p, y)  # (B, H, Q, S) -> (B, H, Q)
    counted = torch.isfinite(ent)
    ent0 = torch.where(counted, ent, torch.zeros_like(ent))
    # the most concentrated row: entropy over its most possible, log(keys it may see) — a causal row with one or two
    # keys is low by construction and names nothing; rows of fewer than 2 keys are not candidates
    keys = (S - logits.isneginf().sum(-1)).to(ent.dtype) if keys is None else keys.to(ent.dtype)  # (B, H, Q)
    norm = (ent / keys.clamp(min=2).log()).masked_fill(keys < 2, float("inf")).nan_to_num_(nan=float("inf"))
    j = norm.flatten().argmin()  # flat over (B, H, Q)
    # (row, position) of a flat (B, H, Q) index; a row's position by index_select, not rows[i] (a 0-d tensor index
    # reads it back under torch.compile)
    pos = (lambda f: rows.index_select(0, f.reshape(1)).reshape(())) if rows is not None else (lambda f: f)
    where = lambda f: torch.stack([torch.div(f, H * Q, rounding_mode="floor"), pos(f % Q)])  # noqa: E731
    return {"max": per_head, "max_at": where(i),
            "entropy_sum": ent0.sum(dim=(0, 2)), "rows": counted.sum(dim=(0, 2)).to(ent.dtype),  # (B, H, Q) -> (H,)
            "min_row": norm.amin(), "min_at": where(j)}


def head_stats(logits: torch.Tensor, keep: torch.Tensor | None = None, positions: int = 0) -> dict[str, torch.Tensor]:
    """The loss head's output logits (B, T, V) (``keep`` (B, T) bool: the loss positions, None: all), over
    ``positions`` positions evenly spaced over the B·T (0: all of them) that are kept: ``max_abs`` the largest
    |logit| and ``max_at`` (2,) its (row, position); ``lse_sq_sum`` Σ logsumexp² and ``n`` how many positions that
    is; ``lse`` (P,) each sampled position's logsumexp (−inf where not kept: a vocabulary shard's, to combine).
    A pass over every logit costs a read of the micro-batch's B·T·V logits per statistic; the sampled
    positions see the same drift. Non-finite logits make the values non-finite (the host drops them)."""
    B, T, V = logits.shape
    flat = logits.reshape(B * T, V)  # (B, T, V) -> (B·T, V)
    at = query_rows(B * T, positions, logits.device) if 0 < positions < B * T else None
    sub = flat if at is None else flat.index_select(0, at)  # (P, V); a fifth of ``flat[at]``'s cost on a CPU
    top = sub.amax(-1)  # (P, V) -> (P,)
    per_pos = torch.maximum(top, -sub.amin(-1)).float()  # (P,), no |x| copy
    # logsumexp = max − max(log-softmax), the log-softmax's largest term being the one at the max: one vectorized
    # log-softmax and a reduction, half of ``torch.logsumexp``'s cost on a CPU (its exp ran scalar), as exact; in
    # float32 whatever the logits' dtype (a bf16 head's log-softmax rounds its log s to bf16's 3 digits)
    lse = each = top.float() - torch.log_softmax(sub, dim=-1, dtype=torch.float32).amax(-1)  # (P,)
    if keep is not None:
        kept = keep.reshape(-1) if at is None else keep.reshape(-1)[at]  # (P,)
        per_pos = torch.where(kept, per_pos, torch.full_like(per_pos, float("-inf")))
        lse = torch.where(kept, lse, torch.zeros_like(lse))
        each = torch.where(kept, each, torch.full_like(each, float("-inf")))
        n = kept.sum().float()
    else:
        n = float(lse.numel())
    i = per_pos.argmax()
    r, t = _unravel(i if at is None else at.index_select(0, i.reshape(1)).reshape(()), (B, T))  # (no .item():
    # a 0-d tensor index would read it back under torch.compile)
    return {"max_abs": per_pos.amax(), "max_at": torch.stack([r, t]), "lse_sq_sum": lse.square().sum(), "n": n,
            "lse": each}


def local_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A DTensor's local shard (under a tensor-parallel plan: a sequence shard of a norm's input with sequence
    parallelism, a vocabulary shard of a column-parallel head's logits) and where its positions (dim 1) start in the
    whole; a plain tensor as it is, from 0. Only metadata is read: no collective, no copy."""
    if not is_dtensor(x):
        return x, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    return x.to_local(), int(offset[1]) if len(offset) > 1 else 0


def shifted(at: torch.Tensor, offset: int) -> torch.Tensor:
    """(row, position) with the position moved by ``offset`` (a shard's start), on the device."""
    return at if not offset else torch.stack([at[0], at[1] + offset])


def rms_stats(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The residual stream (B, T, d) at the final norm's input: ``sum`` Σ over positions of each position's RMS,
    ``n`` the positions, ``max`` the largest and ``max_at`` (2,) its (row, position)."""
    B, T, d = x.shape
    rms = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32) / math.sqrt(d)  # (B, T, d) -> (B, T)
    r, t = _unravel(rms.flatten().argmax(), (B, T))
    return {"sum": rms.sum(), "n": float(B * T), "max": rms.amax(),
            "max_at": torch.stack([r, t])}


def router_stats(logits: torch.Tensor, chosen: torch.Tensor | None, top_k: int) -> dict[str, torch.Tensor]:
    """A MoE router's logits (N, E) (any leading dims) and its chosen experts (N, k) (None: the top ``top_k`` of
    the logits): ``entropy_sum`` Σ routing entropy over tokens, ``n`` the tokens, ``counts`` (E,) tokens routed to
    each expert."""
    E = logits.shape[-1]
    flat = logits.reshape(-1, E).float()  # (*lead, E) -> (N, E)
    ent = torch.special.entr(torch.softmax(flat, dim=-1)).sum(-1)  # (N,)
    if chosen is None:
        chosen = flat.topk(min(top_k, E), dim=-1).indices  # (N, k)
    idx = chosen.reshape(-1).long()  # (N, k) -> (N·k,)
    counts = torch.zeros(E, device=flat.device).index_add_(0, idx, torch.ones_like(idx, dtype=torch.float32))  # (E,)
    return {"entropy_sum": ent.sum(), "n": float(flat.shape[0]), "counts": counts}


__all__ = ["attention_logits", "attention_stats", "causal", "sampled_attention_stats", "head_stats", "query_rows", "router_stats", "rms_stats"]
