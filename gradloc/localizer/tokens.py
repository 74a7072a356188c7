"""The token level: rounds of one probe per rank over the job's candidate tokens, their growth, then pruning and
naming (``localizer.py``'s module docstring, step 2). Functions of the one :class:`~gradloc.localizer.runner.Runner`
(its probe budget, session and collectives); every rank takes the same path."""
from __future__ import annotations

import numpy as np
import torch

from gradloc.localizer.context import LocalizeResult, by_micro_batch, rest_carries_spike, still_spike
from gradloc.localizer.naming import name
from gradloc.localizer.probes import Grads
from gradloc.localizer.prune import Measured, prune
from gradloc.localizer.runner import Runner
from gradloc.records import Level, Localization, Method, Status


def token_rounds(r: Runner, cands: list) -> LocalizeResult | str:
    """Rounds of one probe per rank over the job's candidates, grown while the step is still a spike without them;
    the verified set pruned and named (module docstring of ``localizer.py``, step 2), else why not."""
    view, cfg, scope, session = r.view, r.cfg, r.scope, r.session
    mine = [c for c in cands if c.rank == r.rank]
    groups = by_micro_batch(view, [c.flat for c in mine])
    order = sorted(groups, key=lambda m: -float(view.rank_scores[groups[m]].sum()))
    n_groups = [len({c.m for c in cands if c.rank == k}) for k in range(r.W)]
    rounds = min(cfg.max_probes, max(n_groups))
    acc: Grads = [None] * len(r.stored.grads)
    start, error = len(session.losses), ""
    cum: list[float] = []  # a linear scope's running ⟨∇_C, ∇⟩/‖∇‖²: each round's own share, measured
    for i in range(rounds):
        acc, err = r.probe_round(acc, (order[i], groups[order[i]]) if i < len(order) else None)
        r.spend()
        error = error or err
        if scope.linear and i < rounds - 1:
            cum.append(scope.measure(acc, 0.0, error)[0])
    taken = [groups[m] for m in order[:rounds]]
    explained, loss = scope.measure(acc, float(sum(session.losses[start:])), error)
    each = [float(x) for x in np.diff([0.0, *cum, explained])] if scope.linear or rounds == 1 else None
    first, first_share = len(taken), explained
    acc, explained, loss, grown = grow(r, acc, explained, loss, taken, start)
    flats = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
    if r.verified(explained, loss):
        firsts = [*taken[:first]] + [np.zeros(0, dtype=np.int64)] * (rounds - first)  # the job's rounds
        parts = [*zip(firsts, each)] if each is not None else \
            [(np.concatenate(firsts) if firsts else np.zeros(0, dtype=np.int64), first_share)]
        named = prune(r, Measured(acc=acc, explained=explained, loss=loss, rounds=tuple(taken[:first]),
                                     round_shares=each, first=first_share, n_rounds=rounds,
                                     parts=(*parts, *grown)), flats)
        naming = name(r, named.parts, named.explained, grown=tuple(f for f, _ in grown))
        note = "; ".join(x for x in (_note(n_groups, rounds, r.W), grown_note(r, grown), named.note,
                                     naming.note) if x)
        loc = located(r, naming.flats, naming.shares, named.explained, scope.norms(named.acc), named.loss,
                            r.used, note)
        return LocalizeResult(loc, named.acc if r.keep_grad else None, unnamed=naming.unnamed)
    n = int(r.comm.all_reduce(torch.tensor([float(flats.size)], dtype=torch.float64), what="gradloc count")[0]) \
        if not r.solo else flats.size
    on = "" if r.solo else f" on {len({c.rank for c in cands})} rank(s)"
    why = (f"the top {n} attributed token(s){on} explain only {explained:.2f} of ‖∇‖² "
           "and less than half of the spike's excess")
    skipped = sum(max(k - rounds, 0) for k in n_groups)
    if skipped:
        why += f" (candidates in {skipped} more micro-batches not probed: max_probes)"
    del acc
    return why


def grow(r: Runner, acc: Grads, explained: float, loss: float, taken: list[np.ndarray],
         phase_start: int) -> tuple[Grads, float, float, list[tuple[np.ndarray, float]]]:
    """While the step would still be a spike without C, a round probes each rank's next outlier
    tokens (relative threshold ÷ 10, over the job's untaken tokens), one micro-batch per rank. ∇ is
    linear in the token mask, so the new tokens' gradient adds exactly to ∇_C. Also returns each
    round's part: (this rank's tokens, the job's measured share of the round)."""
    view, scope, session = r.view, r.scope, r.session
    grown: list[tuple[np.ndarray, float]] = []
    while r.left > 0:
        _, without = scope.norms(acc)
        if not still_spike(without, r.ctx):
            break
        if r.verified(explained, loss) and \
                not rest_carries_spike(explained, r.stored.norm, r.ctx):
            break  # the residual's norm is the rest of the step uncovered, not the spike's excess
        if r.left <= 1 and not r.verified(explained, loss):
            break  # the last probe is kept for the levels below the tokens (below.py)
        free = view.eligible.copy()
        for t in taken:
            free[t] = False
        extra = relaxed(r, free)
        if not r.comm.all_reduce(torch.tensor([float(extra.size > 0)]), op="max", what="gradloc grow")[0]:
            break
        group = None
        if extra.size:
            groups = by_micro_batch(view, extra)
            m = view.locate(int(extra[0]))[0]
            group = (m, groups[m])
            taken.append(groups[m])
        start, before = len(session.losses), explained
        if scope.linear:
            acc, err = r.probe_round(acc, group)
            explained, loss = scope.measure(acc, float(sum(session.losses[phase_start:])), err)
        else:
            new, err = r.probe_round([None] * len(acc), group)
            d_exp, d_loss = scope.measure(new, float(sum(session.losses[start:])), err)
            acc = [a if n is None else (n if a is None else a.add_(n)) for a, n in zip(acc, new)]
            explained, loss = explained + d_exp, loss + d_loss
        grown.append((group[1] if group is not None else np.zeros(0, dtype=np.int64), explained - before))
        r.spend()
    return acc, explained, loss, grown

def grown_note(r: Runner, grown: list[tuple[np.ndarray, float]]) -> str:
    """What the growth rounds added to C, measured (every rank runs the same rounds)."""
    if not grown:
        return ""
    mine = float(sum(f.size for f, _ in grown))
    n = int(mine if r.solo else r.comm.all_reduce(torch.tensor([mine], dtype=torch.float64),
                                                        what="gradloc grown count")[0])
    return (f"{n} token(s) added by {len(grown)} growth round(s), the step's rest still above its spike line without "
            f"them: {sum(x for _, x in grown):.1%} of ‖∇‖², measured")

def relaxed(r: Runner, free: np.ndarray) -> np.ndarray:
    """This rank's untaken tokens above the job's relaxed floor, best first (≤ max_candidates)."""
    s = np.where(free, r.view.rank_scores, 0.0)  # (N,)
    pool = s[free]
    local = torch.tensor([float(s.max()) if s.size else 0.0, float(np.median(pool)) if pool.size else 0.0],
                         dtype=torch.float64)
    rows = r.comm.all_gather(local, "gradloc grow floor").numpy()  # (W, 2)
    top = float(rows[:, 0].max())
    if top <= 0:
        return np.zeros(0, dtype=np.int64)
    floor = max(r.cfg.candidate_rel_score / 10 * top, r.cfg.candidate_outlier_factor * float(np.median(rows[:, 1])))
    order = np.argsort(-s, kind="stable")
    return order[s[order] >= floor][: r.cfg.max_candidates]


def located(r: Runner, flats: np.ndarray, shares: np.ndarray, explained: float, norms: tuple[float, float],
             loss: float, probes: int, note: str) -> Localization:
    """``flats``: this rank's named tokens, ``shares`` their estimated shares (``naming.py``)."""
    culprits, spans, samples = r.gather_records([int(f) for f in flats], [float(x) for x in shares])
    level = Level.SPAN if any(x.end - x.start > 1 for x in spans) else Level.TOKEN
    return r.record(method=Method.ATTRIBUTION, status=Status.LOCATED, level=level, probes=probes,
                       culprits=culprits, spans=spans, samples=samples, note=note, explained=explained,
                       norms=norms, loss=loss)


def _note(n_groups: list[int], rounds: int, world: int) -> str:
    skipped = sum(max(n - rounds, 0) for n in n_groups)
    if world == 1:
        return f"candidates in {skipped} more micro-batches not probed (max_probes)" if skipped else ""
    note = f"{rounds} probe round(s), each rank probing its own candidates in parallel across {world} ranks"
    return note + (f"; candidates in {skipped} more micro-batch(es) not probed (max_probes)" if skipped else "")


__all__ = ["grow", "located", "relaxed", "token_rounds"]
