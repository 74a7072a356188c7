"""Which tokens of a verified set a located localization names: the ones that carry the spike.

A verified token set C (``localizer.py``'s token rounds, after ``prune.py``) comes as *parts*: each probe
round's tokens with the round's measured share of ‖∇‖² (a linear scope measures every round apart,
an inner product, no probe; a non-linear one its growth rounds apart and its first rounds together;
``prune.py``'s measured subset is a part of its own). A token's share is its part's share split by
attribution score within the part, an estimate. C can hold tokens whose share is negligible: a
healthy token probed beside a culprit in one micro-batch (one probe cannot tell them apart), the
tail of a growth round. Without another probe, the record names the *carriers*:

1. Units, not tokens: C's tokens grouped into runs of adjacent positions of one sample (the spans
   ``spans.py`` builds), each with the sum of its tokens' shares; a long run of small tokens (a
   repeated tail, padding) is judged as the one unit it is, never cut.
2. Sorted by share, the job's units are cut after the first k — the smallest k such that
   (a) every unit after the cut is an order of magnitude below the smallest named one
   (|share| < ``GAP`` × it): a cut never falls inside a set of comparable units, so an evenly
   spread C is named whole; (b) the units after the cut carry, together, less than
   ``MIN_SAMPLE_SHARE`` of ‖∇‖² (the share below which the levels name no sample either,
   ``levels.py``): what is left unnamed could not be named on its own; and (c) the named units
   alone, by their shares, are still the answer C is: they pass the verification test and, when C
   leaves no spike uncovered, leave none either (``context.rest_carries_spike``), as ``prune.py``
   asks of what it drops; (d) each growth round's largest unit is named: the round ran because the
   step without it would still be flagged, measured (``localizer.py``'s growth) — what the estimates of
   (c) cannot see when the rest of the step leans on C (⟨∇ − ∇_C, ∇_C⟩ > 0: a 2% culprit of
   ``bench localization``'s ``three_mb`` seed 3 was left unnamed before this). Its companions in
   the round are cut like any unit.
3. Nothing is hidden: the note says how many tokens of the verified set are not named and what
   they carry together. ``explained_share``, the norms, the loss fields and the remedy's ∇_C stay
   those of the whole verified set C (no probe measures the named units apart), and the note says so.

Every rank takes the same cut: the units' shares are gathered (one ``all_gather_object``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gradloc.localizer.context import rest_carries_spike
from gradloc.localizer.levels import MIN_SAMPLE_SHARE

if TYPE_CHECKING:
    from gradloc.localizer.runner import Runner

GAP = 0.1  # a unit left unnamed is below this × the smallest named unit's share: an order of magnitude


@dataclass(frozen=True, kw_only=True)
class Naming:
    """This rank's named tokens, their estimated shares, and what the record says of the rest."""

    flats: np.ndarray
    shares: np.ndarray
    unnamed: int  # tokens of the verified set not named (the job's)
    note: str


def token_shares(run: "Runner", parts: tuple[tuple[np.ndarray, float], ...]) -> tuple[np.ndarray, np.ndarray]:
    """(this rank's flats, their estimated shares): each part's measured share split by score within the part
    (over the job: the parts' score totals are all-reduced)."""
    w = [run.view.rank_scores[f] for f, _ in parts]
    local = torch.tensor([float(x.sum()) for x in w], dtype=torch.float64)  # (parts,)
    totals = (run.comm.all_reduce(local, what="gradloc culprit scores") if not run.solo else local).tolist()
    flats = np.concatenate([f for f, _ in parts]) if parts else np.zeros(0, dtype=np.int64)
    shares = np.concatenate([share * x / t if math.isfinite(share) and t > 0 else x * np.nan
                             for x, t, (_, share) in zip(w, totals, parts)]) if parts else np.zeros(0)
    return flats.astype(np.int64), shares.astype(np.float64)


def units(run: "Runner", flats: np.ndarray) -> list[np.ndarray]:
    """This rank's tokens grouped into runs of adjacent positions of one sample (indices into ``flats``)."""
    where = sorted(range(flats.size), key=lambda i: run.view.locate(int(flats[i])))
    out: list[list[int]] = []
    last = None
    for i in where:
        m, b, t = run.view.locate(int(flats[i]))
        if last is not None and last == (m, b, t - 1):
            out[-1].append(i)
        else:
            out.append([i])
        last = (m, b, t)
    return [np.asarray(u, dtype=np.int64) for u in out]


def cut(shares: list[float], enough, at_least: int = 1) -> int:  # noqa: ANN001 - enough(named share) -> bool
    """The number of units named, ``shares`` sorted descending (the module docstring's step 2), at least
    ``at_least`` (the growth rounds' carriers, step 2d)."""
    for k in range(max(at_least, 1), len(shares)):
        smallest, rest = shares[k - 1], shares[k:]
        if smallest <= 0 or max(abs(x) for x in rest) >= GAP * smallest:
            continue
        if sum(max(x, 0.0) for x in rest) < MIN_SAMPLE_SHARE and enough(sum(shares[:k])):
            return k
    return len(shares)


def name(run: "Runner", parts: tuple[tuple[np.ndarray, float], ...], explained: float,
         grown: tuple[np.ndarray, ...] = ()) -> Naming:
    """The named tokens of a verified set given as ``parts`` (module docstring); ``explained``: its measured share;
    ``grown``: this rank's tokens of each growth round (the job's rounds, in order)."""
    flats, shares = token_shares(run, parts)
    norm, ctx = run.stored.norm, run.ctx
    groups = units(run, flats)
    rounds = [frozenset(g for g, f in enumerate(grown) if np.isin(flats[u], f).any()) for u in groups]
    mine = [(float(shares[u].sum()), tuple(sorted(g))) for u, g in zip(groups, rounds)]
    every = [mine] if run.solo else run.comm.all_gather_object(mine, "gradloc naming units")
    job = sorted(((s, r, i, g) for r, items in enumerate(every) for i, (s, g) in enumerate(items)),
                 key=lambda x: (-x[0] if math.isfinite(x[0]) else math.inf, x[1], x[2]))
    if not job or not all(math.isfinite(x[0]) for x in job) or not math.isfinite(explained):
        return Naming(flats=flats, shares=shares, unnamed=0, note="")
    complete = not rest_carries_spike(explained, norm, ctx)

    def enough(share: float) -> bool:  # the named units alone: the answer C is (step 2c)
        return run.verified(share) and not (complete and rest_carries_spike(share, norm, ctx))

    # step 2d: each growth round's largest unit (the job's units sorted: its first) is named
    pinned = [next(k for k, x in enumerate(job) if g in x[3]) for g in range(len(grown))
              if any(g in x[3] for x in job)]
    k = cut([x[0] for x in job], enough, at_least=max(pinned, default=-1) + 1)
    if k == len(job):
        return Naming(flats=flats, shares=shares, unnamed=0, note="")
    rank = run.rank if not run.solo else 0
    keep = sorted(i for _, r, i, _ in job[:k] if r == rank)
    idx = np.concatenate([groups[i] for i in keep]) if keep else np.zeros(0, dtype=np.int64)
    sizes = [len(groups[i]) if r == rank else 0 for _, r, i, _ in job[k:]]
    n = sum(sizes) if run.solo else int(run.comm.all_reduce(torch.tensor([float(sum(sizes))], dtype=torch.float64),
                                                            what="gradloc naming count")[0])
    left = sum(x[0] for x in job[k:])
    note = (f"{n} more token(s) of the verified set not named: {left:.2%} of ‖∇‖² together (estimated), each "
            f"run < {GAP:g}× the smallest named; explained share, norms and ∇_C are the whole verified set's")
    return Naming(flats=flats[idx], shares=shares[idx], unnamed=n, note=note)


__all__ = ["GAP", "Naming", "cut", "name", "token_shares", "units"]
