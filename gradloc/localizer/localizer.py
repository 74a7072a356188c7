"""Spike -> Localization: one-pass attribution, verified by ≤ max_probes probes.

Verification: for the candidate set C (grouped by micro-batch, one probe per micro-batch) we get
∇_C and the culprits' loss ℓ_C, and compare with the stored training gradient ∇ (never recomputed):
explained_share = ⟨∇_C, ∇⟩ / ‖∇‖², norm_without_culprits = ‖∇ − ∇_C‖, loss_without = ℓ − ℓ_C.
C is *verified* when it explains ≥ s = min_explained_share of ‖∇‖², or of the spike's *excess*
over the healthy level (⟨∇_C, ∇⟩ ≥ s·(‖∇‖² − μ²)), or carries ≥ s of the step's (positive) loss
or of its excess over the healthy loss. The loss criteria matter for a corrupted label: its
cross-entropy gradient is bounded, so its share of ‖∇‖² can be modest while it carries most of
the loss.

Outcomes (``Localization.status``): ``located`` (a verified culprit set, at the ``Localization.level``
where the data went wrong: token, span, sample or micro-batch), ``diffuse`` (nothing at any level
carries the spike; the measured sample shares are reported), ``unverified`` (candidates without a
probe closure), ``unavailable`` (no per-token statistics). When the token candidates fail, the
rest of the budget goes below the tokens (``below.py``): the decomposition probe (``decompose.py``)
measures every sample's and token's exact share of one micro-batch at once. The token phase grows
its candidate set only while one probe stays for that. Bisection runs per ``LocalizerConfig.bisection``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch
from torch import nn

from gradloc.config import LocalizerConfig
from gradloc.localizer.bisection import bisect, sqrt_threshold
from gradloc.localizer.candidates import select_candidates
from gradloc.localizer.diffuse import describe, sample_shares
from gradloc.localizer.probes import Grads, ProbeSession, distance, dot, grad_norm
from gradloc.localizer.spans import Decode, build_culprits, build_spans
from gradloc.localizer.token_view import TokenView
from gradloc.records import Level, Localization, Method, Status

MAX_UNATTRIBUTED = 0.5  # above this share of ‖∇‖² outside per-token rules, attribution is not trusted


@dataclass(frozen=True)
class SpikeContext:
    healthy_norm: float | None  # detector's EMA mean of the global norm (also bisection's noise level)
    loss: float | None  # the step's loss as reported to end_step
    healthy_loss: float | None  # detector's EMA mean of the loss
    healthy_std: float | None = None  # detector's EMA std of the global norm
    z_threshold: float = 2.5  # a residual above healthy_norm + z·std is still a spike


@dataclass(frozen=True)
class StoredGradient:
    grads: Grads  # the training gradient, as the optimizer will see it (possibly GradScaler-scaled)
    inv_scale: float
    norm: float  # unscaled global norm


@dataclass(frozen=True)
class LocalizeResult:
    localization: Localization
    culprit_grad: Grads | None = None  # unscaled ∇_C of a verified culprit set, when asked to keep it


@dataclass(frozen=True)
class _Measured:
    """A probed token set: its gradient, explained share, norms and loss."""

    cands: np.ndarray
    grad: Grads
    explained: float
    c_norm: float
    without: float
    loss: float
    unprobed: int = 0  # micro-batches holding candidates that max_probes left unprobed


class Localizer:
    def __init__(self, cfg: LocalizerConfig, decode: Decode | None) -> None:
        self.cfg, self.decode = cfg, decode

    def localize(self, step: int, view: TokenView | None, stored: StoredGradient,
                 open_probes: Callable[[], ProbeSession] | None, ctx: SpikeContext,
                 keep_grad: bool = False, head: "nn.Module | None" = None) -> LocalizeResult:
        """``head``: the module of the view's exact layer (the loss head), for the decomposition probe."""
        if view is None or view.scores.size == 0:
            return LocalizeResult(self._unavailable(step, view, stored, "no per-token statistics for this step"))
        # Non-finite positions from every layer's scores, not only the exact layer's that rank candidates
        # (an overflow in an earlier layer's backward leaves the exact layer finite).
        bad = np.flatnonzero(view.eligible & ~(np.isfinite(view.scores) & np.isfinite(view.rank_scores)))
        if bad.size:
            bad = bad[: self.cfg.max_candidates]
            return LocalizeResult(self._result(step, Method.ATTRIBUTION, Status.LOCATED, 0, None, stored, view, bad,
                                               np.full(bad.size, np.nan), None,
                                               "non-finite gradient: culprits are the positions where it appears"))
        if view.unattributed_share > MAX_UNATTRIBUTED:
            why = (f"attribution unavailable: {view.unattributed_share:.0%} of ‖∇‖² is in parameters "
                   "no per-token rule covers")
            if open_probes is None or self.cfg.bisection == "off":
                return LocalizeResult(self._unavailable(step, view, stored, why))
            with open_probes() as session:
                return self._bisect(step, view, stored, session, ctx, why, keep_grad)
        cands = select_candidates(view.rank_scores, view.eligible, self.cfg)
        if open_probes is None:
            return LocalizeResult(self._without_probes(step, view, stored, cands))
        with open_probes() as session:
            why = "no token stands out in the attribution scores"
            if cands.size:
                got = self._verify(view, stored, cands, session, ctx, grow_to=self.cfg.max_probes - 1)
                if self._verified(got.explained, stored.norm, got.loss, ctx):
                    loc = self._located(step, Method.ATTRIBUTION, stored, view, got, session.count, ctx)
                    return LocalizeResult(loc, got.grad if keep_grad else None)
                why = (f"the top {got.cands.size} attributed token(s) explain only {got.explained:.2f} of ‖∇‖² "
                       "and less than half of the spike's excess")
                if got.unprobed:
                    why += f" (candidates in {got.unprobed} more micro-batches not probed: max_probes)"
                del got
            if self.cfg.bisection == "on_failure":
                return self._bisect(step, view, stored, session, ctx, why, keep_grad)
            from gradloc.localizer.below import Below

            return Below(self, step, view, stored, session, ctx, head).run(why, keep_grad)

    # -- attribution + verification -------------------------------------------------------------
    def _verify(self, view: TokenView, stored: StoredGradient, cands: np.ndarray, session: ProbeSession,
                ctx: SpikeContext, grow_to: int) -> _Measured:
        groups = _by_micro_batch(view, cands)
        kept = sorted(groups, key=lambda m: -float(view.rank_scores[groups[m]].sum()))[: self.cfg.max_probes]
        cands = np.concatenate([groups[m] for m in kept])
        g_c: Grads = [None] * len(stored.grads)
        for m in kept:
            g_c = _probe_into(session, view, g_c, m, groups[m])
        cands, g_c = self._grow(view, stored, session, ctx, cands, g_c, grow_to)
        return _Measured(cands, g_c, *_explained(stored, g_c), sum(session.losses), len(groups) - len(kept))

    def _grow(self, view: TokenView, stored: StoredGradient, session: ProbeSession, ctx: SpikeContext,
              cands: np.ndarray, g_c: Grads, grow_to: int) -> tuple[np.ndarray, Grads]:
        """While the step would still be a spike without C and fewer than ``grow_to`` probes ran (or
        ``max_probes`` once C is verified already), probe the next outlier tokens (relaxed relative threshold), one micro-batch per probe. ∇ is
        linear in the token mask, so probing only the new tokens adds exactly their gradient to ∇_C."""
        relaxed = replace(self.cfg, candidate_rel_score=self.cfg.candidate_rel_score / 10)
        while session.count < self.cfg.max_probes:
            explained, _, without = _explained(stored, g_c)
            if not _still_spike(without, ctx):
                break
            if session.count >= grow_to and not self._verified(explained, stored.norm, sum(session.losses), ctx):
                break  # the last probe is kept for the levels below the tokens (below.py)
            taken = np.zeros(view.scores.size, dtype=bool)
            taken[cands] = True
            extra = select_candidates(view.rank_scores, view.eligible & ~taken, relaxed)
            if extra.size == 0:
                break
            groups = _by_micro_batch(view, extra)
            m = view.locate(int(extra[0]))[0]
            g_c = _probe_into(session, view, g_c, m, groups[m])
            cands = np.concatenate([cands, groups[m]])
        return cands, g_c

    def _verified(self, explained: float, norm: float, loss_c: float, ctx: SpikeContext) -> bool:
        need = self.cfg.min_explained_share
        if not math.isfinite(explained) or explained <= 0:
            return False  # a set pointing against the gradient cannot be what made it spike
        if explained >= need:
            return True
        mu = ctx.healthy_norm
        if mu is not None and norm > mu and explained * norm**2 >= need * (norm**2 - mu**2):
            return True
        loss, mu_l = ctx.loss, ctx.healthy_loss
        if loss is None or not math.isfinite(loss) or loss <= 0:
            return False
        if loss_c >= need * loss:
            return True
        return mu_l is not None and loss > mu_l and loss_c >= need * (loss - mu_l)

    def _located(self, step: int, method: str, stored: StoredGradient, view: TokenView, got: _Measured,
                 probes: int, ctx: SpikeContext, weights: np.ndarray | None = None, note: str = "") -> Localization:
        w = view.rank_scores[got.cands] if weights is None else weights
        shares = got.explained * w / w.sum() if math.isfinite(got.explained) and w.sum() > 0 else w * np.nan
        if got.unprobed:
            note = (note + "; " if note else "") + f"candidates in {got.unprobed} more micro-batches not probed (max_probes)"
        return self._result(step, method, Status.LOCATED, probes, got.explained, stored, view, got.cands, shares,
                            (got.c_norm, got.without), note, _loss_fields(ctx, got.loss))

    def _without_probes(self, step: int, view: TokenView, stored: StoredGradient, cands: np.ndarray) -> Localization:
        if cands.size:
            total = float(view.scores.sum())
            return self._result(step, Method.ATTRIBUTION, Status.UNVERIFIED, 0, None, stored, view, cands,
                                view.scores[cands] / total, None, "no probe closure given: shares are attribution scores")
        samples = sample_shares(view, None, 0)
        note = "no token stands out in the attribution scores (no probe closure: nothing measured); " + \
            describe(samples, _n_samples(view))
        return self._empty(step, Method.ATTRIBUTION, Status.DIFFUSE, 0, stored, view, note, samples)

    # -- fallback ---------------------------------------------------------------------------------
    def _bisect(self, step: int, view: TokenView, stored: StoredGradient, session: ProbeSession,
                ctx: SpikeContext, why: str, keep_grad: bool) -> LocalizeResult:
        n_tokens = max(int(view.eligible.sum()), 1)
        reference = ctx.healthy_norm if ctx.healthy_norm else stored.norm
        threshold = sqrt_threshold(reference / math.sqrt(n_tokens), self.cfg.bisection_sigma)
        groups = [np.flatnonzero(view.eligible[a:b]) + a for a, b in zip(view.offsets, view.offsets[1:])]
        single_loss: dict[int, float] = {}

        def grad_of(m: int, flats: np.ndarray) -> Grads:
            g = _probe_into(session, view, [None] * len(stored.grads), m, flats)
            if len(flats) == 1:
                single_loss[int(flats[0])] = session.losses[-1]
            return g

        res = bisect(groups, grad_of, threshold, max(self.cfg.bisection_budget - session.count, 1))
        note = f"{why}; bisection" + (" stopped at its probe budget" if res.exhausted else "")
        if res.grad is None:
            return LocalizeResult(self._empty(step, Method.BISECTION, Status.DIFFUSE, session.count, stored, view,
                                              f"{note}: no token subset above the noise threshold; "
                                              f"{describe(sample_shares(view, None, 0), _n_samples(view))}",
                                              sample_shares(view, None, 0)))
        cands = np.asarray(res.culprits, dtype=np.int64)
        got = _Measured(cands, res.grad, *_explained(stored, res.grad),
                        sum(single_loss.get(int(c), 0.0) for c in cands))
        if not self._verified(got.explained, stored.norm, got.loss, ctx):
            samples = sample_shares(view, None, 0)
            return LocalizeResult(self._empty(
                step, Method.BISECTION, Status.DIFFUSE, session.count, stored, view,
                f"{note}: {cands.size} hot token(s) explain only {got.explained:.2f} of ‖∇‖²; "
                f"{describe(samples, _n_samples(view))}", samples))
        loc = self._located(step, Method.BISECTION, stored, view, got, session.count, ctx,
                            weights=np.asarray(res.norms) ** 2, note=note)
        return LocalizeResult(loc, got.grad if keep_grad else None)

    # -- records ----------------------------------------------------------------------------------
    def _result(self, step, method, status, probes, explained, stored, view, cands, shares, norms, note,
                loss_fields: tuple[float | None, float | None] = (None, None)) -> Localization:
        culprits = build_culprits(view, [int(c) for c in cands], [float(s) for s in shares], self.decode)
        spans = build_spans(view, culprits, self.decode, self.cfg.context_tokens)
        c_norm, without = norms if norms else (None, None)
        level = Level.NONE
        if status == Status.LOCATED:
            level = Level.SPAN if any(s.end - s.start > 1 for s in spans) else Level.TOKEN
        return Localization(step=step, method=method, status=status, level=level, probes=probes,
                            explained_share=explained, global_norm=stored.norm, culprit_norm=c_norm,
                            norm_without_culprits=without, culprits=culprits, spans=spans,
                            micro_batch_shares=view.micro_batch_shares(), unattributed_share=view.unattributed_share,
                            loss_share=loss_fields[0], loss_without_culprits=loss_fields[1], note=note,
                            samples=sample_shares(view, None, 0))

    @staticmethod
    def _empty(step: int, method: Method, status: Status, probes: int, stored: StoredGradient, view: TokenView,
               note: str, samples: tuple = (), passes: int = 0) -> Localization:
        return Localization(step=step, method=method, status=status, probes=probes, passes=passes,
                            global_norm=stored.norm, micro_batch_shares=view.micro_batch_shares(),
                            unattributed_share=view.unattributed_share, note=note, samples=samples)

    @staticmethod
    def _unavailable(step: int, view: TokenView | None, stored: StoredGradient, note: str) -> Localization:
        return Localization(step=step, method=Method.NONE, status=Status.UNAVAILABLE, probes=0, global_norm=stored.norm,
                            micro_batch_shares=view.micro_batch_shares() if view else (),
                            unattributed_share=view.unattributed_share if view else 0.0, note=note)


def _n_samples(view: TokenView) -> int:
    return sum(m.n_samples for m in view.metas)


def _loss_fields(ctx: SpikeContext, loss_c: float) -> tuple[float | None, float | None]:
    """(loss_share, loss_without_culprits) when the step's loss is known."""
    if ctx.loss is None or not math.isfinite(ctx.loss) or ctx.loss == 0:
        return None, None
    return loss_c / ctx.loss, ctx.loss - loss_c


def _probe_into(session: ProbeSession, view: TokenView, acc: Grads, m: int, flats: np.ndarray) -> Grads:
    return session.add_to(acc, view.metas[m].index, torch.from_numpy(view.mask_for(m, flats)))


def _still_spike(norm: float, ctx: SpikeContext) -> bool:
    if ctx.healthy_norm is None or ctx.healthy_std is None or not math.isfinite(norm):
        return False
    return norm > ctx.healthy_norm + ctx.z_threshold * ctx.healthy_std


def _by_micro_batch(view: TokenView, flats: np.ndarray) -> dict[int, np.ndarray]:
    groups: dict[int, list[int]] = {}
    for f in flats:
        groups.setdefault(view.locate(int(f))[0], []).append(int(f))
    return {m: np.asarray(v, dtype=np.int64) for m, v in groups.items()}


def _explained(stored: StoredGradient, g_c: Grads) -> tuple[float, float, float]:
    """(⟨∇_C, ∇⟩/‖∇‖², ‖∇_C‖, ‖∇ − ∇_C‖) with ∇ the unscaled stored gradient. ‖∇ − ∇_C‖ is computed
    directly: from ‖∇‖² − 2⟨∇_C, ∇⟩ + ‖∇_C‖² it would cancel when the culprits dominate."""
    total_sq = stored.norm ** 2
    inner = dot(g_c, stored.grads, stored.inv_scale)
    explained = inner / total_sq if total_sq > 0 else float("nan")
    return explained, grad_norm(g_c), distance(stored.grads, g_c, stored.inv_scale)
