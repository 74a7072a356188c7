"""What a localization is judged against, and the verification test every level uses.

C is *verified* when it explains ≥ s = ``min_explained_share`` of ‖∇‖², or of the spike's *excess*
over the healthy level (⟨∇_C, ∇⟩ ≥ s·(‖∇‖² − μ²)), or carries ≥ s of the step's (positive) loss or
of its excess over the healthy loss. The loss criteria matter for a corrupted label: its
cross-entropy gradient is bounded, so its share of ‖∇‖² can be modest while it carries most of the
loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gradloc.localizer.probes import Grads, ProbeSession, distance, dot, grad_norm
from gradloc.localizer.token_view import TokenView
from gradloc.records import Localization

MAX_UNATTRIBUTED = 0.5  # above this share of ‖∇‖² outside per-token rules, attribution is not trusted


@dataclass(frozen=True)
class SpikeContext:
    healthy_norm: float | None  # detector's EMA mean of the global norm (also bisection's noise level)
    loss: float | None  # the step's loss as reported to end_step
    healthy_loss: float | None  # detector's EMA mean of the loss
    # the global-norm line the step was flagged against (detector.norm_line: grad_spike's line, the
    # record's band): a residual above it would still be flagged, a spike; None: no band, never
    spike_line: float | None = None
    # the band's z line, mean + z·std: a residual above it still stands out from the healthy band, flagged or not
    # (the rank level's "is a passing micro-batch the whole story", below.py); None: no band
    band_line: float | None = None
    # (micro-batch index, sample) of this rank's per-sample surprise outliers on the step: the levels
    # below the tokens decompose their micro-batches first (below.py)
    outliers: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class StoredGradient:
    grads: Grads  # the training gradient, as the optimizer will see it (possibly GradScaler-scaled)
    inv_scale: float
    norm: float  # unscaled global norm


@dataclass(frozen=True)
class LocalizeResult:
    localization: Localization
    culprit_grad: Grads | None = None  # unscaled ∇_C of a verified culprit set, when asked to keep it
    unnamed: int = 0  # tokens of the verified set (in ∇_C) that the localization does not name (naming.py)


def verified(need: float, explained: float, norm: float, loss_c: float, ctx: SpikeContext) -> bool:
    """The verification test (module docstring) with s = ``need``."""
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


def still_spike(norm: float, ctx: SpikeContext) -> bool:
    """Would the step still be flagged with this residual norm (above the line it was flagged against)?"""
    if ctx.spike_line is None or not math.isfinite(norm):
        return False
    return norm > ctx.spike_line


def out_of_band(norm: float, ctx: SpikeContext) -> bool:
    """Does this residual norm still stand out from the healthy band (above mean + z·std), flagged or not? Asked
    before a measurement that must pass on its own (the rank level), not before naming tokens."""
    if ctx.band_line is None or not math.isfinite(norm):
        return False
    return norm > ctx.band_line


def rest_carries_spike(explained: float, norm: float, ctx: SpikeContext) -> bool:
    """Does what C does not carry of ‖∇‖², ⟨∇ − ∇_C, ∇⟩ = (1 − explained)·‖∇‖², still reach the squared
    line the step was flagged against (``spike_line``²)? ‖∇ − ∇_C‖ alone can stay above the line when the
    rest of the step partly cancels C (a culprit's gradient larger than the step's own, healthy tokens
    pulling the same rows the other way): removing C then uncovers the cancelled part, healthy data, not
    a missed culprit. Where the rest is orthogonal to C both tests agree (tests/localizer, the tiers toy)."""
    if ctx.spike_line is None or not math.isfinite(explained):
        return True
    return (1.0 - explained) * norm**2 > ctx.spike_line**2


def loss_fields(ctx: SpikeContext, loss_c: float) -> tuple[float | None, float | None]:
    """(loss_share, loss_without_culprits) when the step's loss is known."""
    if ctx.loss is None or not math.isfinite(ctx.loss) or ctx.loss == 0:
        return None, None
    return loss_c / ctx.loss, ctx.loss - loss_c


def probe_into(session: ProbeSession, view: TokenView, acc: Grads, m: int, flats: np.ndarray) -> Grads:
    """``acc`` + the gradient of the tokens ``flats`` of view position m (one probe)."""
    return session.add_to(acc, view.metas[m].index, view.mask(m, flats))


def by_micro_batch(view: TokenView, flats) -> dict[int, np.ndarray]:  # noqa: ANN001 - flat indices
    groups: dict[int, list[int]] = {}
    for f in flats:
        groups.setdefault(view.locate(int(f))[0], []).append(int(f))
    return {m: np.asarray(v, dtype=np.int64) for m, v in groups.items()}


def explained_of(stored: StoredGradient, g_c: Grads) -> tuple[float, float, float]:
    """(⟨∇_C, ∇⟩/‖∇‖², ‖∇_C‖, ‖∇ − ∇_C‖) with ∇ the unscaled stored gradient (one process)."""
    total_sq = stored.norm ** 2
    inner = dot(g_c, stored.grads, stored.inv_scale)
    explained = inner / total_sq if total_sq > 0 else float("nan")
    return explained, grad_norm(g_c), distance(stored.grads, g_c, stored.inv_scale)
