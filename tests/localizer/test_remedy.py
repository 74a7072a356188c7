"""apply_remedy on real localizations of the exact toy: what is applied, what is refused and why."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gradloc.config import LocalizerConfig
from gradloc.localizer.localizer import Localizer
from gradloc.localizer.remedy import apply_remedy
from tests.helpers import single_thread  # noqa: F401
from tests.localizer.toy import Toy, basis, ctx, planted

D = 8
SCALE = 1024.0  # a GradScaler's scale: the stored gradient carries it, ∇_C does not


def located(keep_grad: bool = True):
    """Three culprits in micro-batches 0 and 2; returns (toy, localization, ∇_C, culprit flats)."""
    plants = {(0, 0, 1): basis(D, 1, 40), (0, 0, 2): basis(D, 2, 30), (2, 1, 3): basis(D, 3, 50)}
    toy = planted(plants)
    stored = toy.stored(SCALE)
    res = Localizer(LocalizerConfig(), None).localize(3, toy.view(), stored, toy.scope(stored), ctx(),
                                                      keep_grad=keep_grad)
    assert res.localization.status == "located" and res.localization.probes == 2
    return toy, res.localization, res.culprit_grad, [toy.flat(*k) for k in plants]


def with_grad(toy: Toy) -> torch.Tensor:
    toy.w.grad = toy.grad_of() * SCALE
    return toy.w.grad


def test_drop_culprits_subtracts_the_scaled_culprit_gradient_exactly() -> None:
    toy, loc, g_c, flats = located()
    grad = with_grad(toy)
    extra = torch.nn.Parameter(torch.zeros(3))  # a parameter the culprits do not reach
    extra.grad = torch.ones(3)
    rem = apply_remedy("drop_culprits", loc, g_c + [None], [toy.w, extra], SCALE, has_scaler=True)
    assert (rem.action, rem.applied) == ("drop_culprits", True)
    assert toy.w.grad is grad  # in place: the optimizer's tensor
    assert torch.equal(grad, (toy.grad_of() - toy.grad_of(flats)) * SCALE)  # integers × 2^10: exact
    assert torch.equal(extra.grad, torch.ones(3))
    assert rem.norm_before == loc.global_norm and rem.norm_after == loc.norm_without_culprits
    assert rem.norm_after == pytest.approx(toy.norm(without=flats), abs=1e-6 * toy.norm() ** 2 / toy.norm(without=flats))
    assert rem.reason == "∇ − ∇_C: 3 culprit token(s) dropped from the update"


def test_drop_culprits_says_when_the_verified_set_holds_tokens_not_named() -> None:
    """∇_C is the verified set's gradient; tokens of it the localization does not name (naming.py) are dropped
    with it, and the reason counts them."""
    toy, loc, g_c, _ = located()
    with_grad(toy)
    rem = apply_remedy("drop_culprits", loc, g_c, [toy.w], SCALE, has_scaler=True, unnamed=2)
    assert rem.applied and rem.reason == ("∇ − ∇_C: 3 culprit token(s) and 2 more of the verified set, not named, "
                                          "dropped from the update")


def test_skip_step_sets_every_gradient_to_none() -> None:
    toy, loc, g_c, _ = located()
    with_grad(toy)
    rem = apply_remedy("skip_step", loc, g_c, [toy.w], SCALE, has_scaler=False)
    assert (rem.applied, rem.norm_after, toy.w.grad) == (True, 0.0, None)
    assert rem.reason == "every gradient set to None: the optimizer step changes nothing"


def refusal(action: str, loc, g_c, toy: Toy, has_scaler: bool = False):
    grad = with_grad(toy)
    before = grad.clone()
    rem = apply_remedy(action, loc, g_c, [toy.w], SCALE, has_scaler)
    assert rem.applied is False and rem.norm_after is None
    assert toy.w.grad is grad and torch.equal(grad, before)  # a refusal changes nothing
    return rem


def test_skip_step_is_refused_with_a_scaler() -> None:
    toy, loc, g_c, _ = located()
    rem = refusal("skip_step", loc, g_c, toy, has_scaler=True)
    assert rem.reason == "skip_step is not supported with a GradScaler (its step() needs gradients)"


def not_located(toy: Toy, status: str):
    loc = Localizer(LocalizerConfig(), None)
    if status == "diffuse":  # every token the same vector: no candidate, 3 probes on samples
        uniform = Toy(torch.ones(3, 2, 4, D, dtype=torch.float64))
        return loc.localize(3, uniform.view(), uniform.stored(), uniform.scope(), ctx()).localization
    if status == "unverified":  # no probe closure
        return loc.localize(3, toy.view(), toy.stored(), None, ctx()).localization
    return loc.localize(3, None, toy.stored(), toy.scope(), ctx()).localization  # no per-token statistics


@pytest.mark.parametrize("action", ["drop_culprits", "skip_step"])
@pytest.mark.parametrize("status", ["diffuse", "unverified", "unavailable"])
def test_only_a_located_spike_is_remedied(action: str, status: str) -> None:
    toy, _, g_c, _ = located()
    loc = not_located(toy, status)
    assert loc.status == status
    rem = refusal(action, loc, g_c, toy)
    assert rem.reason == f"not applied to a {status} spike: only a located culprit set qualifies"


@pytest.mark.parametrize("action", ["drop_culprits", "skip_step"])
def test_no_localization_is_refused(action: str) -> None:
    toy, _, g_c, _ = located()
    rem = refusal(action, None, g_c, toy)
    assert rem.reason.startswith("the spike kinds of this step are not localized") and np.isnan(rem.norm_before)


def test_drop_culprits_needs_the_culprit_gradient() -> None:
    toy, loc, _, _ = located(keep_grad=False)
    rem = refusal("drop_culprits", loc, None, toy)
    assert rem.reason == "the culprits were not verified by a probe, so ∇_C is unknown"


def test_a_non_finite_step_located_without_probes_can_be_skipped_but_not_dropped() -> None:
    toy = planted({(1, 0, 0): basis(D, 1, 40)})
    scores = toy.scores()
    scores[5] = np.nan
    loc = Localizer(LocalizerConfig(), None).localize(3, toy.view(scores=scores), toy.stored(), toy.scope(),
                                                      ctx(), keep_grad=True).localization
    assert (loc.status, loc.probes) == ("located", 0)
    rem = refusal("drop_culprits", loc, [toy.grad_of([5])], toy)  # even handed a gradient: not probe-verified
    assert rem.reason == "the culprits were not verified by a probe, so ∇_C is unknown"
    with_grad(toy)
    assert apply_remedy("skip_step", loc, None, [toy.w], SCALE, False).applied and toy.w.grad is None


def test_drop_culprits_is_refused_when_it_would_not_lower_the_norm() -> None:
    """A located set whose removal would not lower ‖∇‖ (reported norm without it ≥ the norm): the remedy
    refuses rather than making the step worse."""
    toy, loc, g_c, _ = located()
    grad = with_grad(toy).clone()
    worse = dataclasses.replace(loc, norm_without_culprits=loc.global_norm * 1.5)
    rem = apply_remedy("drop_culprits", worse, g_c, [toy.w], SCALE, has_scaler=False)
    assert not rem.applied and "would not lower" in rem.reason
    assert torch.equal(toy.w.grad, grad)
