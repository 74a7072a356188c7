"""The localizer's decisions, one test per branch, on an exact toy (tests/localizer/toy.py).

Every token t is a vector v_t; the probe closure's gradient is Σ_{masked t} v_t, the training
gradient is Σ_t v_t and each token's attribution score is ‖v_t‖², so every share, norm, loss and
probe count below has a closed form. Noise tokens are e_0 (score 1); planted tokens are large.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradloc.config import LocalizerConfig
from gradloc.localizer.context import verified
from gradloc.localizer.localizer import Localizer, StoredGradient
from tests.helpers import single_thread  # noqa: F401
from tests.localizer.toy import Toy, basis, ctx, planted

D = 8
F32 = 1e-6  # grad_norm is float32 (foreach_norms): ‖∇_C‖ carries float32 rounding


def residual(toy: Toy, flats) -> object:
    """‖∇ − ∇_C‖ is computed directly in float64 (not as √(‖∇‖² − 2⟨∇_C, ∇⟩ + ‖∇_C‖²), which cancels),
    so on the toy's integer vectors it is exact."""
    return pytest.approx(toy.norm(without=flats), rel=1e-12)


def decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def keys(loc) -> list[tuple[int, int, int]]:
    return sorted((c.micro_batch, c.sample, c.position) for c in loc.culprits)


def localize(toy: Toy, cfg: LocalizerConfig | None = None, *, view=None, probes: bool = True, context=None,
             scale: float = 1.0, keep_grad: bool = False):
    loc = Localizer(cfg or LocalizerConfig(), decode)
    stored = toy.stored(scale)
    return loc.localize(7, toy.view() if view is None else view, stored, toy.scope(stored) if probes else None,
                        context or ctx(), keep_grad=keep_grad)


# -- 1. located by attribution, verified -----------------------------------------------------------
def three_culprits() -> tuple[Toy, list[int]]:
    """Two adjacent culprits in micro-batch 10, one in micro-batch 12 (user indices start at 10)."""
    plants = {(0, 0, 1): basis(D, 1, 40), (0, 0, 2): basis(D, 1, 30) + basis(D, 2, 10), (2, 1, 3): basis(D, 3, 50)}
    toy = planted(plants, first=10)
    return toy, [toy.flat(*k) for k in plants]


@pytest.mark.parametrize("scale", [1.0, 1024.0])
def test_located_by_attribution_with_exact_shares_norms_and_losses(scale: float) -> None:
    toy, c = three_culprits()
    loss = toy.loss_of()  # w = 1: the step's loss is Σ_t Σ_d v_t,d = 151
    res = localize(toy, context=ctx(healthy=20.0, std=5.0, loss=loss, healthy_loss=20.0), scale=scale, keep_grad=True)
    loc = res.localization
    assert (loc.status, loc.method, loc.note) == ("located", "attribution", "")
    assert loc.probes == 2 and toy.opens == 1  # one probe per micro-batch holding candidates: 10 and 12
    assert keys(loc) == [(10, 0, 1), (10, 0, 2), (12, 1, 3)]
    assert loc.explained_share == pytest.approx(toy.share_of(c), rel=1e-12)  # ⟨∇_C, ∇⟩/‖∇‖² = 7500/7941
    assert loc.global_norm == toy.norm()
    assert loc.culprit_norm == pytest.approx(float(toy.grad_of(c).norm()), rel=F32)
    assert loc.norm_without_culprits == residual(toy, c) and toy.norm(without=c) == 21.0  # the noise
    assert loc.loss_share == pytest.approx(toy.loss_of(c) / loss, rel=1e-12)
    assert loc.loss_without_culprits == pytest.approx(loss - toy.loss_of(c), rel=1e-12)
    # per-culprit shares split each probe round's measured share (micro-batch 10's, 12's: measured apart, an inner
    # product in the one-process scope) by attribution score within the round
    scores = toy.scores()
    by_key = {(c_.micro_batch, c_.sample, c_.position): c_ for c_ in loc.culprits}
    rounds = [c[:2], c[:2], c[2:]]
    for flat, key, r in zip(c, [(10, 0, 1), (10, 0, 2), (12, 1, 3)], rounds):
        got = by_key[key]
        assert got.share == pytest.approx(toy.share_of(r) * scores[flat] / scores[r].sum(), rel=1e-12)
        assert got.score_share == pytest.approx(scores[flat] / scores.sum(), rel=1e-12)
        assert (got.token_id, got.text) == (100 + flat, f"<{100 + flat}>")
    assert [x.share for x in loc.culprits] == sorted((x.share for x in loc.culprits), reverse=True)
    # adjacent culprits form one span, with decoded context
    spans = {(s.micro_batch, s.sample, s.start, s.end): s for s in loc.spans}
    assert set(spans) == {(10, 0, 1, 3), (12, 1, 3, 4)}
    s = spans[(10, 0, 1, 3)]
    assert (s.text, s.context_before, s.context_after) == ("<101><102>", "<100>", "<103>")
    # the window the incident page colours: the sample's tokens around the span with their score shares
    assert (s.window_start, s.window_tokens) == (0, ("<100>", "<101>", "<102>", "<103>"))
    assert s.window_scores == pytest.approx(tuple(scores[0:4] / scores.sum()), rel=1e-12)
    assert s.share == pytest.approx(by_key[(10, 0, 1)].share + by_key[(10, 0, 2)].share, rel=1e-12)
    mb = [scores[a:a + 8].sum() / scores.sum() for a in (0, 8, 16)]
    assert loc.micro_batch_shares == pytest.approx(mb, rel=1e-12)
    # ∇_C itself (unscaled, exactly the culprits' summed vectors) only when asked for
    assert len(res.culprit_grad) == 1 and torch.equal(res.culprit_grad[0], toy.grad_of(c))


def test_culprit_grad_is_not_kept_unless_asked() -> None:
    toy, _ = three_culprits()
    res = localize(toy, context=ctx(healthy=20.0, std=5.0))
    assert res.localization.status == "located" and res.culprit_grad is None


def test_candidates_rank_and_shares_split_by_the_position_exact_layer() -> None:
    """The exact layer's scores pick the culprits and split the measured share, even where the
    Σ-over-layers scores (an earlier layer's cross-position attribution, say) point elsewhere."""
    toy = planted({(1, 1, 0): basis(D, 1, 40), (2, 0, 0): basis(D, 2, 30)})
    a, b = toy.flat(1, 1, 0), toy.flat(2, 0, 0)
    misleading = toy.scores()
    misleading[toy.flat(0, 0, 0)] = 1e6
    misleading[b] = 1e4
    loc = localize(toy, view=toy.view(scores=misleading, exact=toy.scores())).localization
    assert loc.status == "located" and keys(loc) == [(1, 1, 0), (2, 0, 0)] and loc.probes == 2
    assert [c.share for c in loc.culprits] == pytest.approx(
        [loc.explained_share * 1600 / 2500, loc.explained_share * 900 / 2500], rel=1e-12)
    assert loc.explained_share == pytest.approx(toy.share_of([a, b]), rel=1e-12)


# -- 2. the verification criteria ---------------------------------------------------------------------
@pytest.mark.parametrize("explained, norm, loss_c, context, expected", [
    (0.5, 10.0, 0.0, ctx(), True),  # explains s of ‖∇‖²
    (0.49, 10.0, 0.0, ctx(), False),
    (0.18, 10.0, 0.0, ctx(healthy=8.0), True),  # 0.18·100 ≥ 0.5·(100 − 64): s of the excess
    (0.17, 10.0, 0.0, ctx(healthy=8.0), False),
    (0.4, 10.0, 0.0, ctx(healthy=10.0), False),  # no excess over the healthy level
    (0.1, 10.0, 2.0, ctx(loss=4.0), True),  # carries s of the loss
    (0.1, 10.0, 1.9, ctx(loss=4.0), False),
    (0.1, 10.0, 0.5, ctx(loss=4.0, healthy_loss=3.0), True),  # s of the loss's excess
    (0.1, 10.0, 0.4, ctx(loss=4.0, healthy_loss=3.0), False),
    (0.1, 10.0, 9.0, ctx(loss=4.0, healthy_loss=5.0), True),  # loss below healthy: the plain loss share still counts
    (0.1, 10.0, 1.9, ctx(loss=4.0, healthy_loss=5.0), False),
    (0.1, 10.0, -5.0, ctx(loss=-1.0), False),  # a non-positive loss is not used
    (0.1, 10.0, 5.0, ctx(loss=math.nan), False),
    (math.nan, 10.0, 5.0, ctx(healthy=1.0, loss=5.0), False),  # a non-finite share never verifies
    (-0.2, 10.0, 5.0, ctx(loss=5.0), False),  # pointing against the gradient: not the cause, whatever its loss
    (0.0, 10.0, 5.0, ctx(loss=5.0), False),
])
def test_verified_criteria(explained, norm, loss_c, context, expected) -> None:
    assert verified(LocalizerConfig().min_explained_share, explained, norm, loss_c, context) is expected


def one_small_culprit(w=None) -> tuple[Toy, int]:
    """10·e_1 among 23 aligned noise tokens: ‖∇‖² = 100 + 529, so the culprit explains only 100/629."""
    toy = planted({(1, 0, 2): basis(D, 1, 10)}, w=w)
    return toy, toy.flat(1, 0, 2)


def test_excess_over_the_healthy_level_verifies_where_the_plain_share_fails() -> None:
    toy, c = one_small_culprit()
    loc = localize(toy, context=ctx(healthy=23.0)).localization  # 100 ≥ 0.5·(629 − 529)
    assert loc.status == "located" and keys(loc) == [(1, 0, 2)] and loc.probes == 1
    assert loc.explained_share == pytest.approx(100 / 629, rel=1e-12) and loc.explained_share < 0.5
    assert loc.norm_without_culprits == residual(toy, [c]) and toy.norm(without=[c]) == 23.0


def test_loss_share_verifies_a_culprit_carrying_most_of_the_loss() -> None:
    toy, c = one_small_culprit(w=basis(D, 0) + basis(D, 1, 3))  # loss = 23 + 30, culprit's = 30
    loc = localize(toy, context=ctx(healthy=20.0, loss=toy.loss_of())).localization
    assert loc.status == "located" and keys(loc) == [(1, 0, 2)]
    assert loc.loss_share == pytest.approx(30 / 53, rel=1e-12)
    assert loc.loss_without_culprits == pytest.approx(23.0, rel=1e-12)


def test_loss_excess_verifies_when_the_plain_loss_share_fails() -> None:
    toy, c = one_small_culprit(w=basis(D, 0) + basis(D, 1, 2))  # loss = 23 + 20, culprit's 20 < 43/2
    loc = localize(toy, context=ctx(healthy=20.0, loss=43.0, healthy_loss=23.0)).localization  # 20 ≥ 0.5·20
    assert loc.status == "located" and loc.loss_share == pytest.approx(20 / 43, rel=1e-12)


def test_all_criteria_failing_gives_a_diffuse_step_with_the_rest_of_the_probes_on_samples() -> None:
    toy, c = one_small_culprit(w=basis(D, 0) + basis(D, 1, 2))
    # no healthy norm: a sample passes only by carrying half of ‖∇‖² (the top one carries 27%)
    loc = localize(toy, context=ctx(loss=43.0, healthy_loss=1.0)).localization
    assert (loc.status, loc.method, loc.culprits, loc.spans) == ("diffuse", "attribution", (), ())
    assert loc.explained_share is None and loc.norm_without_culprits is None
    assert loc.probes == 3  # 1 verification + 2 samples measured
    assert loc.note.startswith("the top 1 attributed token(s) explain only 0.16 of ‖∇‖² "
                               "and less than half of the spike's excess; sample 0 of micro-batch 1 leads with the norm")
    s = loc.samples
    assert [(x.micro_batch, x.sample) for x in s] == [(1, 0), (0, 0), (0, 1), (1, 1), (2, 0)]
    assert s[0].share == pytest.approx(toy.share_of(range(8, 12)), rel=1e-12)  # (100 + 3·23)/629
    assert s[1].share == pytest.approx(toy.share_of(range(0, 4)), rel=1e-12)  # 4·23/629
    assert [x.share for x in s[2:]] == [None, None, None]
    assert s[0].score_share == pytest.approx(103 / 123, rel=1e-12) and s[0].tokens == 4


def test_a_sample_is_named_only_as_an_outlier_among_the_samples() -> None:
    """The same step against a healthy norm of 20: the culprit's sample carries 169 of the excess
    629 − 400 (over half), but only 27% of ‖∇‖², under the floor for 6 samples (max(0.1, 2.5/6)):
    the aligned noise makes every sample look alike, so no sample is named."""
    toy, c = one_small_culprit(w=basis(D, 0) + basis(D, 1, 2))
    loc = localize(toy, context=ctx(healthy=20.0, loss=43.0, healthy_loss=1.0)).localization
    assert (loc.status, loc.level, loc.culprits, loc.spans) == ("diffuse", "", (), ())
    assert loc.samples[0].share == pytest.approx(169 / 629, rel=1e-12)


# -- 3. growing the candidate set while the residual is still a spike --------------------------------
def tiers() -> Toy:
    """One big culprit (100·e_1, micro-batch 1) and second-tier tokens below the first threshold
    (0.1 × top) but far above the noise (18 tokens of e_0): 21·e_2 twice in micro-batch 0, 20·e_3 twice
    in micro-batch 2 with a third-tier 5·e_4 + 2·e_5 (score 29: under 0.1 × the next top, 400, but over
    the relaxed 0.01 × 400 and 20 × the median). Residual ‖∇ − ∇_C‖ after each probe: √3717 ≈ 61.0,
    √1953 ≈ 44.2, then 18 (the noise)."""
    return planted({(1, 0, 1): basis(D, 1, 100), (0, 0, 0): basis(D, 2, 21), (0, 1, 3): basis(D, 2, 21),
                    (2, 0, 1): basis(D, 3, 20), (2, 1, 2): basis(D, 3, 20), (2, 0, 3): basis(D, 4, 5) + basis(D, 5, 2)})


@pytest.mark.parametrize("max_probes, std, expected_mbs", [
    (3, 4.0, [0, 1, 2]),  # still a spike (> 19 + 2.5·4 = 29) after the first two probes
    (2, 4.0, [0, 1]),  # the budget stops the growth
    (3, 12.0, [0, 1]),  # 44.2 < 19 + 2.5·12 = 49: no longer a spike, stop
    (3, None, [1]),  # no healthy std: no growth
])
def test_grow_probes_the_next_outliers_one_micro_batch_per_probe(max_probes, std, expected_mbs) -> None:
    """The third-tier token (2, 0, 3) the last growth round probed carries 29 of ‖∇‖² = 13,717 (0.21%); its
    estimate, its round's measured share (1,629) split by score (29 of 829), is 0.42%, under a tenth of the smallest
    other named token's (5.7%): it stays in the verified set (explained share, norms) and is not named, the note
    says so (naming.py)."""
    toy = tiers()
    loc = localize(toy, LocalizerConfig(max_probes=max_probes), context=ctx(healthy=19.0, std=std)).localization
    assert loc.status == "located" and loc.probes == len(expected_mbs)
    planted_by_mb = {0: [(0, 0, 0), (0, 1, 3)], 1: [(1, 0, 1)], 2: [(2, 0, 1), (2, 0, 3), (2, 1, 2)]}
    probed = sorted(k for m in expected_mbs for k in planted_by_mb[m])
    assert keys(loc) == [k for k in probed if k != (2, 0, 3)]
    flats = [toy.flat(*k) for k in probed]
    assert loc.explained_share == pytest.approx(toy.share_of(flats), rel=1e-12)
    assert loc.norm_without_culprits == residual(toy, flats)
    third = [toy.flat(*k) for k in planted_by_mb[2]]
    unnamed = toy.share_of(third) * 29 / 829 if 2 in expected_mbs else 0.0  # its round's share, split by score
    assert sum(c.share for c in loc.culprits) + unnamed == pytest.approx(loc.explained_share, rel=1e-12)
    if 2 in expected_mbs:
        assert "5 token(s) added by 2 growth round(s)" in loc.note and \
            "1 more token(s) of the verified set not named: 0.42% of ‖∇‖² together (estimated)" in loc.note


def test_grow_stops_when_the_residual_is_the_rest_of_the_step_uncovered() -> None:
    """A culprit 40·e_1 whose gradient the step's other tokens partly cancel (two −6·e_1 tokens of micro-
    batch 0, relaxed candidates: score 36 ≥ 0.01 × 1600 and ≥ 20 × the median, < 0.1 × 1600), beside 21
    noise tokens e_0: ∇ = 28·e_1 + 21·e_0, ‖∇‖ = 35. Without C the residual −12·e_1 + 21·e_0 has norm
    √585 ≈ 24.2, above the line 19 + 2.5·1.5 = 22.75, but it carries ⟨∇ − ∇_C, ∇⟩ = 105 of ‖∇‖² (below the
    line's square, 517.6): the rest of the step, uncovered — GRPO's other completions on a stale token's
    row (issue 32's persistent fault). The culprit alone is named; before, the two cancelling tokens were
    grown into the set (3 culprits, 2 probes)."""
    plants = {(1, 0, 1): basis(D, 1, 40), (0, 0, 2): basis(D, 1, -6), (0, 1, 1): basis(D, 1, -6)}
    toy = planted(plants)
    loc = localize(toy, context=ctx(healthy=19.0, std=1.5)).localization
    assert toy.norm() == 35.0 and toy.norm(without=[toy.flat(1, 0, 1)]) > 19.0 + 2.5 * 1.5
    assert loc.status == "located" and loc.probes == 1
    assert keys(loc) == [(1, 0, 1)]
    assert loc.explained_share == pytest.approx(toy.share_of([toy.flat(1, 0, 1)]), rel=1e-12)  # 1120 / 1225


# -- 4. candidates in more micro-batches than max_probes ------------------------------------------------
def test_candidates_left_unprobed_by_max_probes_are_named_in_the_note() -> None:
    plants = {(0, 0, 0): basis(D, 1, 50), (1, 0, 0): basis(D, 2, 40), (2, 0, 0): basis(D, 3, 60),
              (3, 0, 0): basis(D, 4, 45)}
    toy = planted(plants, M=4)
    loc = localize(toy).localization
    assert loc.status == "located" and loc.probes == 3
    assert keys(loc) == [(0, 0, 0), (2, 0, 0), (3, 0, 0)]  # micro-batch 1 holds the smallest score sum
    assert loc.explained_share == pytest.approx(toy.share_of([0, 16, 24]), rel=1e-12)
    assert loc.note == "candidates in 1 more micro-batches not probed (max_probes)"


# -- 5. diffuse ---------------------------------------------------------------------------------------------
def even_toy() -> Toy:
    """Every token is one basis vector, e_{(b·T + t) mod D}: all scores equal, ∇ = 3·Σ_k e_k."""
    V = torch.zeros(3, 2, 4, D, dtype=torch.float64)
    for b in range(2):
        for t in range(4):
            V[:, b, t, b * 4 + t] = 1.0
    return Toy(V)


def test_diffuse_spends_the_probes_on_the_top_samples_and_says_it_is_spread_evenly() -> None:
    toy = even_toy()
    loc = localize(toy).localization
    assert (loc.status, loc.method, loc.culprits, loc.spans, loc.probes) == ("diffuse", "attribution", (), (), 3)
    assert [(s.micro_batch, s.sample) for s in loc.samples] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert [s.share for s in loc.samples[3:]] == [None, None]
    for s in loc.samples[:3]:
        assert s.share == pytest.approx(1 / 6, rel=1e-12) and s.score_share == pytest.approx(1 / 6, rel=1e-12)
    assert loc.note.startswith("no token stands out in the attribution scores; spread evenly over 6 samples: "
                               "none carries more than 17% of ‖∇‖² (mb 0/sample 0: 17% measured, 17% attributed;")


def test_diffuse_measures_exact_sample_shares() -> None:
    g = torch.Generator().manual_seed(0)
    V = torch.randint(0, 2, (3, 2, 4, D), generator=g).double() * 2 - 1  # ±1: every score is D
    toy = Toy(V)
    loc = localize(toy, LocalizerConfig(max_probes=2)).localization
    assert loc.status == "diffuse" and loc.probes == 2
    T = 4
    for s in loc.samples[:2]:
        start = (s.micro_batch * 2 + s.sample) * T
        assert s.share == pytest.approx(toy.share_of(range(start, start + T)), rel=1e-12, abs=1e-15)
    assert all(s.share is None for s in loc.samples[2:])


def test_a_sample_that_carries_the_norm_is_located_at_the_sample_level() -> None:
    """Sample 1 of micro-batch 2 has 4·e_0 at each position (score 16 < 20 × the median 1, so no
    token stands out) and carries 16·19/404 = 75% of ‖∇‖²: a probe measures it, and the sample is
    named (it was ``diffuse`` with the sample only listed, before the levels)."""
    toy = even_toy()
    toy.V[2, 1] = basis(D, 0, 4)
    loc = localize(toy).localization
    assert (loc.status, loc.level, loc.culprits) == ("located", "sample", ())
    assert loc.explained_share == pytest.approx(toy.share_of(range(20, 24)), rel=1e-12) and loc.explained_share > 0.5
    (span,) = loc.spans
    assert (span.micro_batch, span.sample, span.start, span.end) == (2, 1, 0, 4)
    top = loc.samples[0]
    assert (top.micro_batch, top.sample) == (2, 1) and top.share == loc.explained_share
    assert "1 sample(s) measured by probes carry 75% of ‖∇‖² (sample level" in loc.note


# -- 6. without a probe closure -------------------------------------------------------------------------
def test_candidates_without_a_closure_are_unverified_with_attribution_shares() -> None:
    toy, c = three_culprits()
    loc = localize(toy, probes=False).localization
    assert (loc.status, loc.method, loc.probes, loc.explained_share) == ("unverified", "attribution", 0, None)
    assert loc.note == "no probe closure given: shares are attribution scores"
    scores = toy.scores()
    assert keys(loc) == [(10, 0, 1), (10, 0, 2), (12, 1, 3)]
    assert sorted(x.share for x in loc.culprits) == pytest.approx(sorted(scores[c] / scores.sum()), rel=1e-12)
    assert all(x.share == x.score_share for x in loc.culprits)


def test_no_candidates_without_a_closure_is_diffuse_with_nothing_measured() -> None:
    loc = localize(even_toy(), probes=False).localization
    assert (loc.status, loc.probes, loc.culprits) == ("diffuse", 0, ())
    assert len(loc.samples) == 5 and all(s.share is None for s in loc.samples)
    assert loc.note.startswith("no token stands out in the attribution scores (no probe closure: nothing measured); "
                               "spread evenly over 6 samples")


# -- 7. non-finite scores --------------------------------------------------------------------------------
def test_non_finite_scores_are_located_where_they_appear_without_probes() -> None:
    eligible = torch.ones(3, 2, 4, dtype=torch.bool)
    eligible[0, 0, 3] = False
    toy = planted({(1, 0, 0): basis(D, 1, 40)}, eligible=eligible)
    scores = toy.scores()
    scores[[toy.flat(0, 1, 1), toy.flat(2, 0, 2)]] = [np.nan, np.inf]
    scores[toy.flat(0, 0, 3)] = np.nan  # no loss term there: never a culprit
    loc = localize(toy, view=toy.view(scores=scores)).localization
    assert (loc.status, loc.method, loc.probes, loc.explained_share) == ("located", "attribution", 0, None)
    assert keys(loc) == [(0, 1, 1), (2, 0, 2)]
    assert all(math.isnan(c.share) for c in loc.culprits)
    assert loc.note == "non-finite gradient: culprits are the positions where it appears"
    assert toy.opens == 0
    capped = localize(toy, LocalizerConfig(max_candidates=1), view=toy.view(scores=scores)).localization
    assert keys(capped) == [(0, 1, 1)]  # the first max_candidates positions, in flat order


@pytest.mark.parametrize("bad", [[(2, 1, 1)], [(1, 0, 0)]])
def test_non_finite_sum_scores_are_located_even_where_the_exact_layer_is_finite(bad) -> None:
    """A NaN/Inf arising in an earlier layer's backward (fp16 overflow, say) shows in the Σ-over-layers
    scores while the position-exact layer's are finite. The culprits are where it appears — not the
    exact layer's outliers (here (0, 0, 1) and (1, 0, 0)), and no probe runs on a non-finite gradient."""
    toy = planted({(0, 0, 1): basis(D, 1, 40), (1, 0, 0): basis(D, 2, 40)})
    scores = toy.scores()
    scores[[toy.flat(*k) for k in bad]] = np.nan
    g = toy.grad_of()
    g[0] = math.nan
    stored = StoredGradient([g], 1.0, math.nan)
    loc = Localizer(LocalizerConfig(), None).localize(7, toy.view(scores=scores, exact=toy.scores()), stored,
                                                      toy.scope(stored), ctx()).localization
    assert (loc.status, loc.probes, keys(loc)) == ("located", 0, bad)
    assert loc.note == "non-finite gradient: culprits are the positions where it appears"


def test_a_culprit_set_against_the_gradient_is_not_located_even_if_it_carries_the_loss() -> None:
    """−10·e_0 + e_1 among aligned e_0 noise, loss weights w = e_1: the token carries the whole loss, but
    its gradient points against the rest (explained share < 0), so dropping it would raise ‖∇‖."""
    toy = planted({(1, 0, 2): basis(D, 0, -10) + basis(D, 1, 1)}, w=basis(D, 1))
    loc = localize(toy, context=ctx(healthy=5.0, loss=toy.loss_of())).localization
    assert loc.status == "diffuse" and loc.culprits == ()
    assert "explain only -" in loc.note


def test_non_finite_scores_are_located_before_the_unattributed_check() -> None:
    toy, _ = three_culprits()
    scores = toy.scores()
    scores[toy.flat(1, 1, 1)] = np.inf
    loc = localize(toy, view=toy.view(scores=scores, unattributed=0.7)).localization
    assert (loc.status, loc.probes, keys(loc)) == ("located", 0, [(11, 1, 1)])
    assert toy.opens == 0  # no bisection on a non-finite gradient: its norms are NaN


# -- 8. unavailable ---------------------------------------------------------------------------------------
def test_no_view_is_unavailable() -> None:
    toy, _ = three_culprits()
    loc = Localizer(LocalizerConfig(), None).localize(7, None, toy.stored(), toy.scope(), ctx()).localization
    assert (loc.status, loc.method, loc.probes, loc.culprits) == ("unavailable", "none", 0, ())
    assert loc.note == "no per-token statistics for this step" and loc.global_norm == toy.norm()
    assert toy.opens == 0


@pytest.mark.parametrize("bisection, probes", [("off", True), ("fallback", False)])
def test_mostly_unattributed_norm_is_unavailable_without_bisection(bisection: str, probes: bool) -> None:
    toy, _ = three_culprits()
    loc = localize(toy, LocalizerConfig(bisection=bisection), view=toy.view(unattributed=0.6), probes=probes)
    loc = loc.localization
    assert (loc.status, loc.method, loc.probes, loc.culprits) == ("unavailable", "none", 0, ())
    assert loc.note == "attribution unavailable: 60% of ‖∇‖² is in parameters no per-token rule covers"
    assert loc.unattributed_share == 0.6 and toy.opens == 0


# -- 9. bisection ---------------------------------------------------------------------------------------------
# With healthy norm μ over 24 eligible tokens and κ = 4, a subset of n tokens is hot above 4·μ/√24·√n.
def test_fallback_bisection_finds_the_planted_tokens_when_attribution_is_unavailable() -> None:
    toy = planted({(0, 1, 2): basis(D, 1, 100), (2, 0, 1): basis(D, 2, 60)})
    view = toy.view(scores=np.ones(24), unattributed=0.6)  # scores no use: bisection alone finds them
    loc = localize(toy, view=view, context=ctx(healthy=22.0, loss=toy.loss_of())).localization
    assert (loc.status, loc.method) == ("located", "bisection")
    assert keys(loc) == [(0, 1, 2), (2, 0, 1)]
    assert loc.probes == 3 + 2 * 6  # micro-batch scan, then 8 → 4 → 2 → 1 (2 probes a level) per culprit
    flats = [toy.flat(0, 1, 2), toy.flat(2, 0, 1)]
    assert loc.explained_share == pytest.approx(toy.share_of(flats), rel=1e-12)
    assert loc.norm_without_culprits == residual(toy, flats) and toy.norm(without=flats) == 22.0
    assert loc.loss_share == pytest.approx(160 / 182, rel=1e-12)  # Σ of the single-token probes' losses
    split = [loc.explained_share * 10000 / 13600, loc.explained_share * 3600 / 13600]  # by each token's ‖∇_t‖²
    assert [c.share for c in loc.culprits] == pytest.approx(split, rel=F32)
    assert loc.note == "attribution unavailable: 60% of ‖∇‖² is in parameters no per-token rule covers; bisection"


def misattributed() -> tuple[Toy, np.ndarray]:
    """The true culprit (100·e_1 at (2, 1, 2)) has a tiny attribution score; a noise token (0, 0, 1)
    has the outlier score, and explains only 23/10529 of ‖∇‖² when probed."""
    toy = planted({(2, 1, 2): basis(D, 1, 100)})
    scores = np.ones(24)
    scores[toy.flat(0, 0, 1)] = 1000.0
    return toy, scores


def test_on_failure_bisection_runs_after_a_failed_verification() -> None:
    toy, scores = misattributed()
    loc = localize(toy, LocalizerConfig(bisection="on_failure"), view=toy.view(scores=scores),
                   context=ctx(healthy=23.0)).localization
    assert (loc.status, loc.method, keys(loc)) == ("located", "bisection", [(2, 1, 2)])
    assert loc.probes == 1 + 3 + 6  # the failed verification, the scan, one halving search
    assert loc.explained_share == pytest.approx(10000 / 10529, rel=1e-12)
    assert loc.note == ("the top 1 attributed token(s) explain only 0.00 of ‖∇‖² and less than half of the "
                        "spike's excess; bisection")


def test_the_bisection_budget_counts_the_verification_probes() -> None:
    """1 verification probe + the 9 a full search needs > bisection_budget = 9: it stops one split short."""
    toy, scores = misattributed()
    loc = localize(toy, LocalizerConfig(bisection="on_failure", bisection_budget=9), view=toy.view(scores=scores),
                   context=ctx(healthy=23.0)).localization
    assert (loc.status, loc.method, loc.culprits, loc.probes) == ("diffuse", "bisection", (), 1 + 3 + 4)
    assert "; bisection stopped at its probe budget: no token subset above the noise threshold; " in loc.note


def test_fallback_policy_does_not_bisect_after_a_failed_verification() -> None:
    toy, scores = misattributed()
    loc = localize(toy, view=toy.view(scores=scores), context=ctx(healthy=23.0)).localization
    assert (loc.status, loc.method, loc.culprits, loc.probes) == ("diffuse", "attribution", (), 3)


def two_halves() -> Toy:
    """Two equal culprits, 100·e_1 and 100·e_2, each explaining 10000/20484 < 0.5 alone; healthy
    level 15 < the noise's 22, so neither alone explains half of the excess either."""
    return planted({(0, 1, 2): basis(D, 1, 100), (2, 0, 1): basis(D, 2, 100)})


def test_bisection_out_of_budget_says_so_and_lists_no_unverified_token() -> None:
    toy = two_halves()
    cfg = LocalizerConfig(bisection_budget=10)  # scan (3) + one halving search (6); the next split needs 2 more
    loc = localize(toy, cfg, view=toy.view(unattributed=0.6), context=ctx(healthy=15.0)).localization
    assert (loc.status, loc.method, loc.culprits, loc.spans, loc.probes) == ("diffuse", "bisection", (), (), 9)
    assert loc.note.startswith("attribution unavailable: 60% of ‖∇‖² is in parameters no per-token rule covers; "
                               "bisection stopped at its probe budget: 1 hot token(s) explain only 0.49 of ‖∇‖²; ")
    full = localize(toy, view=toy.view(unattributed=0.6), context=ctx(healthy=15.0)).localization
    assert full.status == "located" and keys(full) == [(0, 1, 2), (2, 0, 1)] and full.probes == 15


def test_bisection_out_of_budget_before_any_split_finds_nothing() -> None:
    toy = two_halves()
    loc = localize(toy, LocalizerConfig(bisection_budget=4), view=toy.view(unattributed=0.6),
                   context=ctx(healthy=15.0)).localization
    assert (loc.status, loc.method, loc.culprits, loc.probes) == ("diffuse", "bisection", (), 3)
    assert "; bisection stopped at its probe budget: no token subset above the noise threshold; " in loc.note


def test_bisection_hot_tokens_that_do_not_explain_the_spike_give_diffuse() -> None:
    """30·e_1 is hot at every level, but 23 noise tokens of 3·e_0 (cold in any micro-batch: 8·3 < 4·15·√(8/24))
    carry 4761 of ‖∇‖² = 5661."""
    toy = planted({(1, 0, 0): basis(D, 1, 30)}, noise=3.0)
    loc = localize(toy, view=toy.view(unattributed=0.6), context=ctx(healthy=15.0)).localization
    assert (loc.status, loc.method, loc.culprits, loc.probes) == ("diffuse", "bisection", (), 3 + 6)
    assert ("; bisection: 1 hot token(s) explain only 0.16 of ‖∇‖²; sample 0 of micro-batch 1 leads with the norm"
            in loc.note)


def test_bisection_on_an_even_step_finds_no_hot_subset() -> None:
    toy = even_toy()
    loc = localize(toy, view=toy.view(unattributed=0.6), context=ctx(healthy=toy.norm())).localization
    assert (loc.status, loc.method, loc.culprits, loc.probes) == ("diffuse", "bisection", (), 3)
    assert loc.note.startswith("attribution unavailable: 60% of ‖∇‖² is in parameters no per-token rule covers; "
                               "bisection: no token subset above the noise threshold; spread evenly over 6 samples")
