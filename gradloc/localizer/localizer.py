"""Spike -> Localization: one-pass attribution, verified by ≤ max_probes probes — on one rank or W.

One algorithm for every scope (``scope.py``): a single process is W = 1, whose collectives are the
identity. Every rank enters together (a spike is judged on the job's step) and takes the same path,
because every decision comes from gathered values:

1. **Picture** — one ``all_gather`` of each rank's fixed-size summary (``picture.py``): no per-token
   statistics anywhere → ``unavailable``; non-finite scores → ``located`` at the positions where they
   appear; more than half of ‖∇‖² outside per-token rules → bisection (one rank only) or
   ``unavailable``; otherwise the job's token candidates (relative and median thresholds).
2. **Tokens** — rounds of one probe per rank (each rank probes its next candidate micro-batch; under
   a lockstep scope the others take part with nothing to probe), then the scope measures the job's
   ⟨∇_C, ∇⟩ / ‖∇‖² and ℓ_C (``context.verified``). While the step would still be a spike without
   C, rounds *grow* C with the next outliers (a relaxed relative threshold) — into the last probe
   only when C is verified already: that probe is kept for the levels below. A probe left after C
   is verified measures its weakest-scored members, which are not named when they carry less than
   a sample must to be named (``prune.py``). The record names C's carriers (``naming.py``): its runs
   of adjacent tokens up to the cut after which every run is below a tenth of the smallest named one
   and all together below 10% of ‖∇‖², the named runs alone still the answer; the note says what is
   not named, and the explained share, norms and ∇_C stay the whole verified set's.
3. **Below the tokens** (``below.py``) — the sample, span or micro-batch that carries it, with the
   decomposition probe (``decompose.py``), else ``diffuse`` with the measured sample shares.
4. **Records** — every rank builds its own culprits and spans (its rank named when W > 1) and one
   ``all_gather_object`` gives every rank the same localization.

``unverified``: some rank gave no probe closure (attribution shares only).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from gradloc.config import LocalizerConfig
from gradloc.localizer.below import Below
from gradloc.localizer.bisect_step import bisect_step
from gradloc.localizer.context import (
    MAX_UNATTRIBUTED,
    LocalizeResult,
    SpikeContext,
    StoredGradient,
    by_micro_batch,
    rest_carries_spike,
    still_spike,
)
from gradloc.localizer.diffuse import describe
from gradloc.localizer.naming import name
from gradloc.localizer.probes import Grads
from gradloc.localizer.prune import Measured, prune
from gradloc.localizer.runner import Runner
from gradloc.localizer.scope import Scope
from gradloc.localizer.spans import Decode
from gradloc.localizer.token_view import TokenView
from gradloc.records import Level, Localization, Method, Status

__all__ = ["Localizer", "LocalizeResult", "SpikeContext", "StoredGradient", "MAX_UNATTRIBUTED"]


class Localizer:
    def __init__(self, cfg: LocalizerConfig, decode: Decode | None) -> None:
        self.cfg, self.decode = cfg, decode

    def localize(self, step: int, view: TokenView | None, stored: StoredGradient, scope: Scope | None,
                 ctx: SpikeContext, *, keep_grad: bool = False, head: nn.Module | None = None,
                 has_probe: bool | None = None) -> LocalizeResult:
        """The one entry, one process or a job's rank alike: ``scope`` is where this rank's probes run and
        combine (``SoloScope`` for one process, ``parallel/scope.py``'s for a job; None: one process without a
        probe closure); ``has_probe``: whether this rank has a probe closure (default: a scope was given);
        ``head``: the view's exact-layer module, for the decomposition probe."""
        probe = has_probe if has_probe is not None else scope is not None
        return _Run(self.cfg, self.decode, step, view, stored, scope, ctx, head, keep_grad, probe).run()


class _Run(Runner):
    """The algorithm's driver over one :class:`Runner` (module docstring): the picture, the token rounds and their
    growth; then pruning and naming, or the levels below the tokens, or bisection."""

    def run(self) -> LocalizeResult:
        pic = self.pic
        if not pic.all_have_view:
            why = "no per-token statistics for this step" if self.solo else \
                "a rank has no per-token statistics for this step"
            return LocalizeResult(self.empty(Method.NONE, Status.UNAVAILABLE, 0, why))
        if pic.nonfinite:
            return LocalizeResult(self._nonfinite())
        if pic.max_unattributed > MAX_UNATTRIBUTED:
            return self._unattributed()
        cands = pic.candidates(self.cfg.candidate_rel_score, self.cfg.candidate_outlier_factor)
        if not pic.all_have_probe or self.scope is None:
            return LocalizeResult(self._unverified(cands))
        with self.scope.session() as session:
            self.session = session
            why = "no token stands out in the attribution scores" if self.solo else \
                "no token stands out in any rank's attribution scores"
            if cands:
                res = self._tokens(cands)
                if isinstance(res, LocalizeResult):
                    return res
                why = res
            if self.cfg.bisection == "on_failure" and self.solo:
                return bisect_step(self, why)
            return Below(self, why).run()

    # -- 2. tokens ----------------------------------------------------------------------------
    def _tokens(self, cands: list) -> LocalizeResult | str:
        view, cfg, scope, session = self.view, self.cfg, self.scope, self.session
        mine = [c for c in cands if c.rank == self.rank]
        groups = by_micro_batch(view, [c.flat for c in mine])
        order = sorted(groups, key=lambda m: -float(view.rank_scores[groups[m]].sum()))
        n_groups = [len({c.m for c in cands if c.rank == r}) for r in range(self.W)]
        rounds = min(cfg.max_probes, max(n_groups))
        acc: Grads = [None] * len(self.stored.grads)
        start, error = len(session.losses), ""
        self.phase_start = start
        cum: list[float] = []  # a linear scope's running ⟨∇_C, ∇⟩/‖∇‖²: each round's own share, measured
        for i in range(rounds):
            acc, err = self.probe_round(acc, (order[i], groups[order[i]]) if i < len(order) else None)
            self.spend()
            error = error or err
            if scope.linear and i < rounds - 1:
                cum.append(scope.measure(acc, 0.0, error)[0])
        taken = [groups[m] for m in order[:rounds]]
        explained, loss = scope.measure(acc, float(sum(session.losses[start:])), error)
        each = [float(x) for x in np.diff([0.0, *cum, explained])] if scope.linear or rounds == 1 else None
        first, first_share = len(taken), explained
        acc, explained, loss, grown = self._grow(acc, explained, loss, taken)
        flats = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
        if self.verified(explained, loss):
            firsts = [*taken[:first]] + [np.zeros(0, dtype=np.int64)] * (rounds - first)  # the job's rounds
            parts = [*zip(firsts, each)] if each is not None else \
                [(np.concatenate(firsts) if firsts else np.zeros(0, dtype=np.int64), first_share)]
            named = prune(self, Measured(acc=acc, explained=explained, loss=loss, rounds=tuple(taken[:first]),
                                         round_shares=each, first=first_share, n_rounds=rounds,
                                         parts=(*parts, *grown)), flats)
            naming = name(self, named.parts, named.explained, grown=tuple(f for f, _ in grown))
            note = "; ".join(x for x in (_note(n_groups, rounds, self.W), self._grown_note(grown), named.note,
                                         naming.note) if x)
            loc = self._located(naming.flats, naming.shares, named.explained, scope.norms(named.acc), named.loss,
                                self.used, note)
            return LocalizeResult(loc, named.acc if self.keep_grad else None, unnamed=naming.unnamed)
        n = int(self.comm.all_reduce(torch.tensor([float(flats.size)], dtype=torch.float64), what="gradloc count")[0]) \
            if not self.solo else flats.size
        on = "" if self.solo else f" on {len({c.rank for c in cands})} rank(s)"
        why = (f"the top {n} attributed token(s){on} explain only {explained:.2f} of ‖∇‖² "
               "and less than half of the spike's excess")
        skipped = sum(max(k - rounds, 0) for k in n_groups)
        if skipped:
            why += f" (candidates in {skipped} more micro-batches not probed: max_probes)"
        del acc
        return why

    def _grow(self, acc: Grads, explained: float, loss: float,
              taken: list[np.ndarray]) -> tuple[Grads, float, float, list[tuple[np.ndarray, float]]]:
        """While the step would still be a spike without C, a round probes each rank's next outlier
        tokens (relative threshold ÷ 10, over the job's untaken tokens), one micro-batch per rank. ∇ is
        linear in the token mask, so the new tokens' gradient adds exactly to ∇_C. Also returns each
        round's part: (this rank's tokens, the job's measured share of the round)."""
        view, scope, session = self.view, self.scope, self.session
        grown: list[tuple[np.ndarray, float]] = []
        while self.left > 0:
            _, without = scope.norms(acc)
            if not still_spike(without, self.ctx):
                break
            if self.verified(explained, loss) and \
                    not rest_carries_spike(explained, self.stored.norm, self.ctx):
                break  # the residual's norm is the rest of the step uncovered, not the spike's excess
            if self.left <= 1 and not self.verified(explained, loss):
                break  # the last probe is kept for the levels below the tokens (below.py)
            free = view.eligible.copy()
            for t in taken:
                free[t] = False
            extra = self._relaxed(free)
            if not self.comm.all_reduce(torch.tensor([float(extra.size > 0)]), op="max", what="gradloc grow")[0]:
                break
            group = None
            if extra.size:
                groups = by_micro_batch(view, extra)
                m = view.locate(int(extra[0]))[0]
                group = (m, groups[m])
                taken.append(groups[m])
            start, before = len(session.losses), explained
            if scope.linear:
                acc, err = self.probe_round(acc, group)
                explained, loss = scope.measure(acc, float(sum(session.losses[self.phase_start:])), err)
            else:
                new, err = self.probe_round([None] * len(acc), group)
                d_exp, d_loss = scope.measure(new, float(sum(session.losses[start:])), err)
                acc = [a if n is None else (n if a is None else a.add_(n)) for a, n in zip(acc, new)]
                explained, loss = explained + d_exp, loss + d_loss
            grown.append((group[1] if group is not None else np.zeros(0, dtype=np.int64), explained - before))
            self.spend()
        return acc, explained, loss, grown

    def _grown_note(self, grown: list[tuple[np.ndarray, float]]) -> str:
        """What the growth rounds added to C, measured (every rank runs the same rounds)."""
        if not grown:
            return ""
        mine = float(sum(f.size for f, _ in grown))
        n = int(mine if self.solo else self.comm.all_reduce(torch.tensor([mine], dtype=torch.float64),
                                                            what="gradloc grown count")[0])
        return (f"{n} token(s) added by {len(grown)} growth round(s), the step's rest still above its spike line without "
                f"them: {sum(x for _, x in grown):.1%} of ‖∇‖², measured")

    def _relaxed(self, free: np.ndarray) -> np.ndarray:
        """This rank's untaken tokens above the job's relaxed floor, best first (≤ max_candidates)."""
        s = np.where(free, self.view.rank_scores, 0.0)  # (N,)
        pool = s[free]
        local = torch.tensor([float(s.max()) if s.size else 0.0, float(np.median(pool)) if pool.size else 0.0],
                             dtype=torch.float64)
        rows = self.comm.all_gather(local, "gradloc grow floor").numpy()  # (W, 2)
        top = float(rows[:, 0].max())
        if top <= 0:
            return np.zeros(0, dtype=np.int64)
        floor = max(self.cfg.candidate_rel_score / 10 * top, self.cfg.candidate_outlier_factor * float(np.median(rows[:, 1])))
        order = np.argsort(-s, kind="stable")
        return order[s[order] >= floor][: self.cfg.max_candidates]

    # -- 1. and 4.: the branches without probes, and the records ------------------------------
    def _located(self, flats: np.ndarray, shares: np.ndarray, explained: float, norms: tuple[float, float],
                 loss: float, probes: int, note: str) -> Localization:
        """``flats``: this rank's named tokens, ``shares`` their estimated shares (``naming.py``)."""
        culprits, spans, samples = self.gather_records([int(f) for f in flats], [float(x) for x in shares])
        level = Level.SPAN if any(x.end - x.start > 1 for x in spans) else Level.TOKEN
        return self.record(method=Method.ATTRIBUTION, status=Status.LOCATED, level=level, probes=probes,
                           culprits=culprits, spans=spans, samples=samples, note=note, explained=explained,
                           norms=norms, loss=loss)

    def _nonfinite(self) -> Localization:
        view = self.view
        bad = np.flatnonzero(view.eligible & ~(np.isfinite(view.scores) & np.isfinite(view.rank_scores)))
        bad = bad[: self.cfg.max_candidates]
        culprits, spans, samples = self.gather_records([int(b) for b in bad], [math.nan] * bad.size)
        note = "non-finite gradient: culprits are the positions where it appears" + \
            ("" if self.solo else ", on the ranks where it appears")
        level = Level.SPAN if any(x.end - x.start > 1 for x in spans) else Level.TOKEN
        return self.record(method=Method.ATTRIBUTION, status=Status.LOCATED, level=level, probes=0,
                           culprits=culprits, spans=spans, samples=samples, note=note)

    def _unattributed(self) -> LocalizeResult:
        why = (f"attribution unavailable: {self.pic.max_unattributed:.0%} of ‖∇‖² is in parameters "
               "no per-token rule covers")
        if not self.solo:
            why = why.replace("attribution unavailable:", "attribution unavailable on a rank:") + \
                "; bisection does not run across ranks"
        if self.scope is None or self.cfg.bisection == "off" or not self.solo:
            return LocalizeResult(self.empty(Method.NONE, Status.UNAVAILABLE, 0, why))
        with self.scope.session() as session:
            self.session = session
            return bisect_step(self, why)

    def _unverified(self, cands: list) -> Localization:
        mine = [c.flat for c in cands if c.rank == self.rank]
        total = self.pic.total_score
        shares = [float(self.view.scores[f]) / total if total > 0 else math.nan for f in mine]
        culprits, spans, samples = self.gather_records(mine, shares)
        if cands:
            why = "no probe closure given: shares are attribution scores" if self.solo else \
                "a rank gave no probe closure: shares are attribution scores"
            return self.record(method=Method.ATTRIBUTION, status=Status.UNVERIFIED, probes=0, culprits=culprits,
                               spans=spans, samples=samples, note=why)
        n = self.n_samples()
        note = "no token stands out in the attribution scores (no probe closure: nothing measured); " + \
            describe(samples, n)
        return self.record(method=Method.ATTRIBUTION, status=Status.DIFFUSE, probes=0, samples=samples, note=note)



def _note(n_groups: list[int], rounds: int, world: int) -> str:
    skipped = sum(max(n - rounds, 0) for n in n_groups)
    if world == 1:
        return f"candidates in {skipped} more micro-batches not probed (max_probes)" if skipped else ""
    note = f"{rounds} probe round(s), each rank probing its own candidates in parallel across {world} ranks"
    return note + (f"; candidates in {skipped} more micro-batch(es) not probed (max_probes)" if skipped else "")
