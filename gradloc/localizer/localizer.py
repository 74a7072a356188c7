"""Spike -> Localization: one-pass attribution, verified by ≤ max_probes probes, bisection fallback.

Verification: for the candidate set C (grouped by micro-batch, one probe per micro-batch) we get
∇_C and the culprits' loss ℓ_C, and compare with the stored training gradient ∇ (never recomputed):
explained_share = ⟨∇_C, ∇⟩ / ‖∇‖², norm_without_culprits = ‖∇ − ∇_C‖, loss_without = ℓ − ℓ_C.
C is *verified* when it explains ≥ s = min_explained_share of ‖∇‖², or of the spike's *excess*
over the healthy level (⟨∇_C, ∇⟩ ≥ s·(‖∇‖² − μ²)), or carries ≥ s of the step's (positive) loss
or of its excess over the healthy loss. The loss criteria matter for a corrupted label: its
cross-entropy gradient is bounded, so its share of ‖∇‖² can be modest while it carries most of
the loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from gradloc.config import LocalizerConfig
from gradloc.localizer.bisection import bisect, sqrt_threshold
from gradloc.localizer.candidates import select_candidates
from gradloc.localizer.probes import Grads, ProbeSession, add_into, dot, grad_norm
from gradloc.localizer.spans import Decode, build_culprits, build_spans
from gradloc.localizer.token_view import TokenView
from gradloc.records import Localization

_MAX_UNATTRIBUTED = 0.5  # above this share of ‖∇‖² outside per-token rules, attribution is not trusted


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


class Localizer:
    def __init__(self, cfg: LocalizerConfig, decode: Decode | None) -> None:
        self.cfg, self.decode = cfg, decode

    def localize(self, step: int, view: TokenView | None, stored: StoredGradient,
                 open_probes: Callable[[], ProbeSession] | None, ctx: SpikeContext) -> Localization:
        usable = view is not None and view.unattributed_share <= _MAX_UNATTRIBUTED and view.scores.size > 0
        if usable:
            cands = select_candidates(view.rank_scores, view.eligible, self.cfg)
            if cands.size and not np.isfinite(view.scores[cands]).all():
                return self._result(step, "attribution", "located", 0, None, stored, view, cands,
                                    np.full(cands.size, float("nan")), None,
                                    "non-finite gradient: culprits are the positions where it appears")
            if cands.size and open_probes is None:
                return self._attribution_only(step, view, stored, cands)
            if cands.size:
                with open_probes() as session:
                    loc = self._verify(step, view, stored, cands, session, ctx)
                    if loc.status == "located" or not self.cfg.fallback_bisection:
                        return loc
                    return self._bisect(step, view, stored, session, ctx, loc.probes, loc.note)
        if view is not None and open_probes is not None and self.cfg.fallback_bisection:
            with open_probes() as session:
                why = "no attribution candidates" if usable else "attribution unavailable (unattributed share too high)"
                return self._bisect(step, view, stored, session, ctx, 0, why)
        return Localization(step, "none", "unavailable", 0, None, stored.norm, None, None, (), (),
                            view.micro_batch_shares() if view else (),
                            view.unattributed_share if view else 0.0,
                            "no per-token statistics or probe closure for this step")

    # -- attribution + verification -------------------------------------------------------------
    def _verify(self, step: int, view: TokenView, stored: StoredGradient, cands: np.ndarray,
                session: ProbeSession, ctx: SpikeContext) -> Localization:
        groups = _by_micro_batch(view, cands)
        kept = sorted(groups, key=lambda m: -float(view.scores[groups[m]].sum()))[: self.cfg.max_probes]
        cands = np.concatenate([groups[m] for m in kept])
        g_c: Grads = [None] * len(stored.grads)
        for m in kept:
            g_c = add_into(g_c, _probe(session, view, m, groups[m]))
        cands, g_c = self._grow(view, stored, session, ctx, cands, g_c)
        explained, c_norm, without = _explained(stored, g_c)
        loss_c = sum(session.losses)
        scores = view.rank_scores[cands]
        shares = explained * scores / scores.sum() if math.isfinite(explained) else scores * float("nan")
        ok = self._verified(explained, stored.norm, loss_c, ctx)
        note = "" if len(kept) == len(groups) else f"candidates in {len(groups) - len(kept)} more micro-batches not probed (max_probes)"
        if not ok:
            note = (note + "; " if note else "") + f"candidates explain only {explained:.2f} of ‖∇‖² and less than half of the spike's excess"
        return self._result(step, "attribution", "located" if ok else "diffuse", session.count, explained,
                            stored, view, cands, shares, (c_norm, without), note, _loss_fields(ctx, loss_c))

    def _grow(self, view: TokenView, stored: StoredGradient, session: ProbeSession, ctx: SpikeContext,
              cands: np.ndarray, g_c: Grads) -> tuple[np.ndarray, Grads]:
        """While the step would still be a spike without C and probes remain, probe the next
        outlier tokens (relaxed relative threshold), one micro-batch per probe. ∇ is linear in the
        token mask, so probing only the new tokens adds exactly their gradient to ∇_C."""
        relaxed = replace(self.cfg, candidate_rel_score=self.cfg.candidate_rel_score / 10)
        while session.count < self.cfg.max_probes:
            _, _, without = _explained(stored, g_c)
            if not _still_spike(without, ctx):
                break
            taken = np.zeros(view.scores.size, dtype=bool)
            taken[cands] = True
            extra = select_candidates(view.rank_scores, view.eligible & ~taken, relaxed)
            if extra.size == 0:
                break
            groups = _by_micro_batch(view, extra)
            m = view.locate(int(extra[0]))[0]
            g_c = add_into(g_c, _probe(session, view, m, groups[m]))
            cands = np.concatenate([cands, groups[m]])
        return cands, g_c

    def _verified(self, explained: float, norm: float, loss_c: float, ctx: SpikeContext) -> bool:
        need = self.cfg.min_explained_share
        if not math.isfinite(explained):
            return False
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

    def _attribution_only(self, step: int, view: TokenView, stored: StoredGradient, cands: np.ndarray) -> Localization:
        total = float(view.scores.sum())
        return self._result(step, "attribution", "unverified", 0, None, stored, view, cands,
                            view.scores[cands] / total, None, "no probe closure given: shares are attribution scores")

    # -- fallback ---------------------------------------------------------------------------------
    def _bisect(self, step: int, view: TokenView, stored: StoredGradient, session: ProbeSession,
                ctx: SpikeContext, used: int, why: str) -> Localization:
        n_tokens = max(int(view.eligible.sum()), 1)
        reference = ctx.healthy_norm if ctx.healthy_norm else stored.norm
        threshold = sqrt_threshold(reference / math.sqrt(n_tokens), self.cfg.bisection_sigma)
        groups = [np.flatnonzero(view.eligible[a:b]) + a for a, b in zip(view.offsets, view.offsets[1:])]

        single_loss: dict[int, float] = {}

        def grad_of(m: int, flats: np.ndarray) -> Grads:
            g = _probe(session, view, m, flats)
            if len(flats) == 1:
                single_loss[int(flats[0])] = session.losses[-1]
            return g

        res = bisect(groups, grad_of, threshold, max(self.cfg.bisection_budget - used, 1))
        g_c: Grads = [None] * len(stored.grads)
        for g in res.grads:
            g_c = add_into(g_c, g)
        explained, c_norm, without = _explained(stored, g_c)
        cands = np.asarray(res.culprits, dtype=np.int64)
        sq = np.asarray(res.norms) ** 2
        shares = explained * sq / sq.sum() if cands.size and math.isfinite(explained) else sq * 0
        loss_c = sum(single_loss.get(int(c), 0.0) for c in cands)
        ok = cands.size > 0 and self._verified(explained, stored.norm, loss_c, ctx)
        note = f"{why}; bisection" + (" stopped at its probe budget" if res.exhausted else "")
        return self._result(step, "bisection", "located" if ok else "diffuse", session.count,
                            explained if cands.size else None, stored, view, cands, shares, (c_norm, without),
                            note, _loss_fields(ctx, loss_c) if cands.size else (None, None))

    def _result(self, step, method, status, probes, explained, stored, view, cands, shares, norms, note,
                loss_fields: tuple[float | None, float | None] = (None, None)) -> Localization:
        culprits = build_culprits(view, [int(c) for c in cands], [float(s) for s in shares], self.decode)
        spans = build_spans(view, culprits, self.decode, self.cfg.context_tokens)
        c_norm, without = norms if norms else (None, None)
        return Localization(step, method, status, probes, explained, stored.norm, c_norm, without,
                            culprits, spans, view.micro_batch_shares(), view.unattributed_share,
                            loss_fields[0], loss_fields[1], note)


def _loss_fields(ctx: SpikeContext, loss_c: float) -> tuple[float | None, float | None]:
    """(loss_share, loss_without_culprits) when the step's loss is known."""
    if ctx.loss is None or not math.isfinite(ctx.loss) or ctx.loss == 0:
        return None, None
    return loss_c / ctx.loss, ctx.loss - loss_c


def _probe(session: ProbeSession, view: TokenView, m: int, flats: np.ndarray) -> Grads:
    return session.grad(view.metas[m].index, torch.from_numpy(view.mask_for(m, flats)))


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
    """(⟨∇_C, ∇⟩/‖∇‖², ‖∇_C‖, ‖∇ − ∇_C‖) with ∇ the unscaled stored gradient."""
    total_sq = stored.norm ** 2
    inner = dot(g_c, stored.grads, stored.inv_scale)
    c_norm = grad_norm(g_c)
    without_sq = max(total_sq - 2 * inner + c_norm**2, 0.0)
    explained = inner / total_sq if total_sq > 0 else float("nan")
    return explained, c_norm, math.sqrt(without_sq)
