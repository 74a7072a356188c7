"""How much data each group (source, tag, length bucket) gave a step: per-sample loss tokens on the device, joined to
the step's one host transfer, then counted per group on the host from the micro-batches' SampleInfos.

Nothing is measured when no micro-batch names a source or a tag: the healthy path without provenance pays nothing.
A sample's tokens are its loss positions (its ``loss_mask``), every position of the sample when no mask was given.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np
import torch

from gradloc.collector.batch import MicroBatchMeta
from gradloc.records.groups import MAX_GROUPS, NO_SOURCE, GroupKind, GroupTokens, length_bucket


def step_tokens(metas: Sequence[MicroBatchMeta], device: torch.device, counters: Counter[str]) -> torch.Tensor | None:
    """:func:`tokens_pack`, never raising into training (a failure is counted: ``group_errors``)."""
    try:
        return tokens_pack(metas, device)
    except Exception:  # noqa: BLE001 - an optional measurement never stops the step
        counters["group_errors"] += 1
        return None


def step_groups(metas: Sequence[MicroBatchMeta], tokens: np.ndarray | None,
                counters: Counter[str]) -> tuple[GroupTokens, ...]:
    """:func:`count_groups` of the step's host tokens (none: no groups), never raising into training."""
    if tokens is None:
        return ()
    try:
        return count_groups(metas, tokens, counters)
    except Exception:  # noqa: BLE001
        counters["group_errors"] += 1
        return ()


def has_groups(metas: Sequence[MicroBatchMeta]) -> bool:
    return any(i.source or i.tags for m in metas for i in (m.sample_infos or ()))


def tokens_pack(metas: Sequence[MicroBatchMeta], device: torch.device) -> torch.Tensor | None:
    """(S,) float64 loss tokens of every sample of the step, in micro-batch then sample order; None without groups."""
    if not has_groups(metas):
        return None
    parts = []
    for m in metas:
        lengths = [b - a for a, b in (m.bounds(s) for s in range(m.n_samples))]
        if m.loss_mask is None:
            parts.append(torch.tensor(lengths, dtype=torch.float64, device=device))
            continue
        mask = m.loss_mask.to(device=device, dtype=torch.float64)  # (B, T)
        if not m.packed:  # one sample per row
            parts.append(mask.sum(dim=1))
            continue
        seg = torch.repeat_interleave(torch.arange(m.n_samples, device=device), torch.tensor(lengths, device=device),
                                      output_size=sum(lengths))  # (N,) each position's sample; no size sync
        parts.append(torch.zeros(m.n_samples, dtype=torch.float64, device=device).index_add_(0, seg, mask.reshape(-1)))  # (1, N) -> (N,)
    return torch.cat(parts)  # (S,)


def count_groups(metas: Sequence[MicroBatchMeta], tokens: np.ndarray,
                 counters: Counter[str]) -> tuple[GroupTokens, ...]:
    """The step's groups from its samples' infos and host ``tokens`` (tokens_pack's values), in first-seen order."""
    samples: dict[tuple[GroupKind, str], list[int]] = {}
    i = 0
    for m in metas:
        for s in range(m.n_samples):
            n, info = int(tokens[i]), m.sample_info(s)
            i += 1
            keys = [(GroupKind.SOURCE, (info.source if info else None) or NO_SOURCE), (GroupKind.LENGTH, length_bucket(n))]
            keys += [(GroupKind.TAG, f"{k}={v}") for k, v in (info.tags if info else ())]
            for key in keys:
                if key not in samples and len(samples) >= MAX_GROUPS:
                    counters["groups_dropped"] += 1
                    continue
                acc = samples.setdefault(key, [0, 0])
                acc[0], acc[1] = acc[0] + 1, acc[1] + n
    return tuple(GroupTokens(kind=k, name=name, samples=a, tokens=b) for (k, name), (a, b) in samples.items())
