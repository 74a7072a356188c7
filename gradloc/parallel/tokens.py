"""A token group's per-token scores, summed once per step: every rank that saw the same tokens (tp, pp)
then holds the whole view.

Each rank scored its own part — its layers (a pipeline stage), its shards (TP), its positions (SP) —
into rows of the job's token layers; one all-reduce over the token group adds them up: the step's
totals, the position-exact row, the per-layer rows (when ``layer_breakdown`` is configured: a rank that
shed its breakdown sends zeros there), the loss head's u_p and which micro-batches have it (when samples
are judged: a vocabulary-parallel head's tp shards each give their columns' part) and four numbers. The
exact row (the loss head's, the last layer of the forward) is only the last stage's under PP; its index
travels with it. The check: a fingerprint
of the step's token ids and loss masks, and its square — peers fed different batches (a loader bug, a
rank out of step) show as a non-zero variance, and the step's per-token statistics are then dropped on
every rank of the group (counted, said once) rather than summed into nonsense. These numbers stay on
the device and travel with the step's one host transfer (``collector/step.py``): no extra sync.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from gradloc.collector.token_summary import StepScores

_P = 1048573  # a prime: the fingerprint stays far below 2^26, so its square is exact in float64


def fingerprint(scores: StepScores) -> torch.Tensor:
    """(0-d float64, on the device) Σ over the step's positions of (id + 1)·(i mod 9973 + 1) + mask·(i mod
    7919 + 1), mod a prime: no host sync (it travels with the step's one host transfer)."""
    dev = scores.totals.device
    total = torch.zeros((), dtype=torch.int64, device=dev)
    for m in scores.metas:
        i = torch.arange(m.n_tokens, dtype=torch.int64, device=dev)
        if m.token_ids is not None:
            total = total + ((m.token_ids.reshape(-1).to(dev).long() + 1) * (i % 9973 + 1)).sum()  # (B, T) -> (B·T,)
        if m.loss_mask is not None:
            total = total + (m.loss_mask.reshape(-1).to(dev).long() * (i % 7919 + 1)).sum()
        total = total + m.n_tokens
    return (total % _P).double()


def combine(scores: StepScores, token: Any, layers: int, breakdown: bool, gives_exact: bool,
            exact_givers: int) -> StepScores:
    """The token group's summed scores, with ``check`` = [Σ f, Σ f², ranks, exact layer + 1] (device,
    read with the step's host transfer: ``mismatch`` and ``exact_layer`` below). ``gives_exact``: this
    rank's exact row is part of the job's (the last pipeline stage; every rank without PP), given by
    ``exact_givers`` ranks of the group (its tp ranks)."""
    n = int(scores.totals.numel())
    dev = scores.totals.device
    f = fingerprint(scores)
    idx = float(scores.exact_layer + 1) if scores.exact_layer is not None and gives_exact else 0.0
    tail = torch.stack([f, f * f, torch.ones((), dtype=torch.float64, device=dev),
                        torch.tensor(idx / exact_givers, dtype=torch.float64, device=dev)])
    parts = [scores.totals.double(), scores.exact.double() if gives_exact else torch.zeros(n, dtype=torch.float64,
                                                                                            device=dev)]
    if breakdown:  # a rank that shed its breakdown sends zeros: the sizes match on every rank
        per = scores.per_layer if scores.per_layer is not None else torch.zeros(layers, n, device=dev)
        parts.append(per.double().flatten())  # (L, N) -> (L·N,)
    heads = scores.head_u is not None and scores.head_has is not None  # the same on every rank (the samples setting)
    if heads:  # the head's u_p: a vocabulary-parallel head's shards add up; ranks without the head give zeros
        g2 = scores.head_g2 if scores.head_g2 is not None else torch.full_like(scores.head_u, float("nan"))
        parts += [scores.head_u.double(), g2.double(), scores.head_has.double()]
        if scores.head_shift is not None:  # the same size on every rank (the samples setting): shards add up
            parts.append(scores.head_shift.double().flatten())  # (2K, N) -> (2K·N,)
    pairs = scores.pairs is not None  # the same on every rank (Megatron SP: the tp ranks hold the same linears)
    if pairs:
        parts.append(scores.pairs.double().flatten())  # (K, 2, N) -> (K·2·N,)
    parts.append(tail)
    sizes = [p.numel() for p in parts]
    got = torch.split(token.all_reduce(torch.cat(parts), what="gradloc token group scores"), sizes)
    totals, exact = got[0], got[1]
    per_layer = got[2].reshape(layers, n) if breakdown and scores.per_layer is not None else None  # (L·N,) -> (L, N)
    if pairs:
        totals, exact, per_layer = _products(got[-2].reshape(-1, 2, n), scores, totals, exact, per_layer)  # (K, 2, N)
    if per_layer is not None:
        per_layer = per_layer.to(scores.totals.dtype)
    shifted = heads and scores.head_shift is not None
    at = -2 - pairs - shifted  # the head rows end here
    u, g2, has = (got[at - 2].float(), got[at - 1].float(), got[at].float()) if heads else (None, None, None)
    shift = got[at + 1].float().reshape(-1, n) if shifted else None  # (2K·N,) -> (2K, N)
    return replace(scores, totals=totals.to(scores.totals.dtype), exact=exact.to(scores.exact.dtype),
                   per_layer=per_layer, check=got[-1], head_u=u, head_has=has, head_g2=g2,
                   head_shift=shift, pairs=None)


def _products(pairs: torch.Tensor, scores: StepScores, totals: torch.Tensor, exact: torch.Tensor,
              per_layer: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Megatron SP (parallel/megatron_sp.py): each linear's summed factors (K, 2, N) multiplied into its weight
    term, added to the totals, its layer's row and the exact row (when it is the exact layer)."""
    prod = pairs[:, 0] * pairs[:, 1]  # (K, 2, N) -> (K, N)
    totals = totals + prod.sum(0)
    per_layer = per_layer.clone() if per_layer is not None else None
    for k, layer in enumerate(scores.pair_layers):
        if layer < 0:
            continue  # not called this step: its factors are zero
        if per_layer is not None:
            per_layer[layer] += prod[k]
        if layer == scores.exact_layer:
            exact = exact + prod[k]
    return totals, exact, per_layer


def mismatch(check: "list[float]") -> bool:
    """Whether the token group's fingerprints differed (host copy of ``check``)."""
    s, s2, k, _ = check
    return s2 / k - (s / k) ** 2 > 0.25


def exact_layer(check: "list[float]") -> int | None:
    ex = check[3]
    return int(round(ex)) - 1 if ex >= 0.5 else None


__all__ = ["combine", "exact_layer", "fingerprint", "mismatch"]
