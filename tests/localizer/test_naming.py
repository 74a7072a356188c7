"""Which tokens of a verified set a located localization names (gradloc/localizer/naming.py): the cut after the
carriers, judged on runs of adjacent tokens, never inside a set of comparable ones, nothing hidden."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gradloc.localizer.naming import GAP, cut, units
from tests.helpers import single_thread  # noqa: F401
from tests.localizer.test_localizer import D, keys, localize
from tests.localizer.toy import basis, ctx, planted


@pytest.mark.parametrize("shares, named", [
    # issue 32's persistent fault on real vLLM (row step 3, step 14, the shares its record had before shares were split
    # per probe round): the three stale tokens named, the three below a tenth of the smallest of them not
    ([0.7268, 0.2248, 0.0338, 0.0009, 0.0008, 0.0004], 3),
    ([0.9719, 0.0097, 0.0056, 0.0028] + [0.0001] * 6, 1),  # row step 2, step 20 (as recorded then)
    ([0.03] * 30, 30),  # an evenly spread set: no cut falls inside comparable units
    ([0.8] + [0.005] * 30, 31),  # the small ones carry 15% together: not negligible, named
    ([0.9, 0.08], 1),  # 0.08 < 0.1 × 0.9 and < 10% of ‖∇‖²
    ([0.9, 0.095], 2),  # within an order of magnitude of the smallest named
    ([0.9, -0.05], 1),  # a unit pointing against ∇ is not a carrier
    ([0.5], 1),
])
def test_the_cut_names_the_carriers(shares, named) -> None:
    assert cut(shares, lambda share: True) == named


def test_no_cut_when_the_named_units_alone_would_not_be_the_answer() -> None:
    shares = [0.45, 0.03, 0.02]  # 0.45 alone fails the (here: ≥ 0.46) verification test C passes
    assert cut(shares, lambda share: share >= 0.46) == 3
    assert cut(shares, lambda share: share >= 0.44) == 1


def test_a_run_of_adjacent_tokens_is_one_unit() -> None:
    """A repeated tail or padding: its tokens are judged by their sum, so a long run of small ones keeps its span."""
    toy = planted({(0, 1, 0): basis(D, 1, 5)}, B=2, T=6)
    run = SimpleNamespace(view=toy.view())
    flats = [toy.flat(0, 1, t) for t in (5, 1, 2, 3)] + [toy.flat(0, 0, 3), toy.flat(2, 1, 0), toy.flat(0, 0, 4)]
    got = sorted(sorted(int(flats[i]) for i in u) for u in units(run, np.asarray(flats)))
    assert got == sorted([[toy.flat(0, 1, t) for t in (1, 2, 3)], [toy.flat(0, 1, 5)],
                          [toy.flat(0, 0, 3), toy.flat(0, 0, 4)], [toy.flat(2, 1, 0)]])
    tail = [0.004] * 40  # 40 tokens of one run at 0.4% each beside a 0.8 culprit: one unit of 16%, named
    assert cut([0.8, sum(tail)], lambda share: True) == 2 and cut([0.8, *tail], lambda share: True) == 41
    assert GAP == 0.1


def test_a_growth_round_s_culprit_is_named_when_the_rest_leans_on_the_set() -> None:
    """``bench localization``'s three_mb seed 3 in a toy: a culprit A = 100·e_1 + 30·e_0 among 21 noise tokens e_0
    (the rest of the step points along A: ⟨∇ − ∇_A, ∇_A⟩ > 0), and a second one G = 20·e_2, its score 400 below the
    first candidate cut (0.1 × 10,900), found by a growth round: without it the residual 20·e_2 + 21·e_0 (‖·‖ 29.0)
    is above the line 19 + 2.5·2 = 24, with it 21 < 24. G carries 400 / 12,751 = 3.1% of ‖∇‖², under a tenth of A's
    (0.85); the estimates alone would cut it (the rest of C's step, ⟨∇ − ∇_C, ∇⟩ = 21·51, is above the line's square,
    so the "leaves no spike uncovered" test does not apply). The growth measured that the step would still be
    flagged without G: it is named (naming.py, step 2d)."""
    a = basis(D, 1, 100) + basis(D, 0, 30)
    toy = planted({(1, 0, 1): a, (2, 0, 1): basis(D, 2, 20)})
    loc = localize(toy, context=ctx(healthy=19.0, std=2.0)).localization
    assert toy.norm(without=[toy.flat(1, 0, 1)]) > 24.0 > toy.norm(without=[toy.flat(1, 0, 1), toy.flat(2, 0, 1)])
    assert loc.status == "located" and loc.probes == 2, loc.note
    assert keys(loc) == [(1, 0, 1), (2, 0, 1)], loc.note
    assert "1 token(s) added by 1 growth round(s)" in loc.note and "not named" not in loc.note
    g = next(c for c in loc.culprits if (c.micro_batch, c.sample, c.position) == (2, 0, 1))
    assert g.share == pytest.approx(toy.share_of([toy.flat(2, 0, 1)]), rel=1e-12)
    assert g.share < GAP * max(c.share for c in loc.culprits)  # what the cut alone would have left unnamed
