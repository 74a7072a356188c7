"""A verified token set's candidates estimated below the naming floor (10% of ‖∇‖²) are measured by a
probe left in the budget and not named when they carry less (gradloc/localizer/prune.py), on the exact
toy (closed-form shares) and on W = 2 ranks against the one-process reference.

The weak candidate 33·e_3 (score 1089, over 0.1 × the culprit's 10,000) sits beside the culprit
100·e_1 among noise tokens e_0; a non-candidate token ±28·e_3 (score 784) makes the weak one's real
share small (−: ⟨∇_v, ∇⟩ = 33·5) or large (+: 33·61) while its score, and so its estimate, stays the same.
"""
from __future__ import annotations

import pytest
import torch

from gradloc.config import LocalizerConfig
from tests.helpers import single_thread  # noqa: F401
from tests.localizer.test_job_localizer import reference, run_job, where
from tests.localizer.test_localizer import F32, D, keys, localize, residual
from tests.localizer.toy import basis, ctx, planted

BIG, WEAK = (1, 0, 1), (1, 0, 2)


def toy(other: float, weak_at=WEAK, other_at=(0, 1, 3)):
    return planted({BIG: basis(D, 1, 100), weak_at: basis(D, 3, 33), other_at: basis(D, 3, other)})


def test_a_weak_candidate_that_carries_little_is_measured_and_not_named() -> None:
    t = toy(-28.0)
    big, weak = t.flat(*BIG), t.flat(*WEAK)
    assert t.share_of([weak]) == pytest.approx(165 / 10466) and t.share_of([big, weak]) > 0.9
    res = localize(t, keep_grad=True)
    loc = res.localization
    assert loc.status == "located" and loc.probes == 2  # the culprits' micro-batch, then the weak one alone
    assert keys(loc) == [BIG]
    assert loc.explained_share == pytest.approx(t.share_of([big]), rel=1e-12)  # 10,000 / 10,466, measured
    assert loc.culprits[0].share == pytest.approx(loc.explained_share, rel=1e-12)
    assert loc.culprit_norm == pytest.approx(100.0, rel=F32) and loc.norm_without_culprits == residual(t, [big])
    assert torch.equal(res.culprit_grad[0], t.grad_of([big]))  # ∇_C − ∇_D, exact on the toy's integers
    assert "1 token(s) estimated below 10% of ‖∇‖² measured: 1.6%, not named" in loc.note


def test_a_weak_candidate_that_carries_more_than_its_estimate_stays_named_with_its_measured_share() -> None:
    t = toy(28.0)
    big, weak = t.flat(*BIG), t.flat(*WEAK)
    loc = localize(t).localization
    assert loc.status == "located" and loc.probes == 2 and keys(loc) == [BIG, WEAK]
    share = {(c.micro_batch, c.sample, c.position): c.share for c in loc.culprits}
    assert share[WEAK] == pytest.approx(t.share_of([weak]), rel=1e-12)  # 2,013 / 14,162 (the split said 0.083)
    assert share[BIG] == pytest.approx(t.share_of([big]), rel=1e-12)
    assert loc.explained_share == pytest.approx(t.share_of([big, weak]), rel=1e-12)
    assert "measured: 14.2%, named" in loc.note


@pytest.mark.parametrize("max_probes, in_set", [(3, [BIG]), (2, [BIG, (2, 0, 0)])])
def test_a_weak_micro_batch_round_is_measured_for_free_and_dropped_with_a_probe_left(max_probes, in_set) -> None:
    """The weak candidate alone in its micro-batch: its round's share is measured exactly (1.6%); a
    third probe drops it from the set; with two probes, none is left (the budget is never exceeded): it stays in
    the verified set (explained share, ∇_C) but is not named, 1.6% < 0.1 × the culprit's 95.5% (naming.py)."""
    t = toy(-28.0, weak_at=(2, 0, 0))
    loc = localize(t, LocalizerConfig(max_probes=max_probes)).localization
    assert loc.status == "located" and loc.probes == min(max_probes, 3) and keys(loc) == [BIG]
    assert loc.explained_share == pytest.approx(t.share_of([t.flat(*k) for k in in_set]), rel=1e-12)
    assert loc.culprits[0].share == pytest.approx(t.share_of([t.flat(*BIG)]), rel=1e-12)  # its round's, measured
    assert ("1 more token(s) of the verified set not named: 1.58% of ‖∇‖² together" in loc.note) == (max_probes == 2)


def test_candidates_at_the_floor_cost_no_probe() -> None:
    t = planted({BIG: basis(D, 1, 100), WEAK: basis(D, 3, 40)})  # 1,600 / 12,084: 13% by estimate and by measure
    loc = localize(t).localization
    assert loc.probes == 1 and keys(loc) == [BIG, WEAK] and loc.note == ""


def test_on_two_ranks_the_weak_candidate_is_dropped_as_on_one() -> None:
    """The culprit on rank 1, the weak candidate on rank 0 (its cancelling token too): one round probes
    both (their shares split by score across the ranks: 9.5% for the weak one), the next measures the
    weak one alone. The one-process reference probes them in two rounds, then drops it with a third."""
    toys = [planted({WEAK: basis(D, 3, 33), (0, 1, 3): basis(D, 3, -28)}), planted({BIG: basis(D, 1, 100)})]
    loc, _ = run_job(toys, ctx())
    ref = reference(toys, ctx())
    assert (loc.status, loc.probes, ref.status, ref.probes) == ("located", 2, "located", 3)
    assert where(loc, True) == where(ref, False) == {(3 + 1, 0, 1)} and loc.culprits[0].rank == 1
    assert loc.explained_share == pytest.approx(ref.explained_share, rel=1e-12)
    assert loc.norm_without_culprits == pytest.approx(ref.norm_without_culprits, rel=1e-12)
