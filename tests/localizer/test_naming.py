"""Which tokens of a verified set a located localization names (gradloc/localizer/naming.py): the cut after the
carriers, judged on runs of adjacent tokens, never inside a set of comparable ones, nothing hidden."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from gradloc.localizer.naming import GAP, cut, units
from tests.helpers import single_thread  # noqa: F401
from tests.localizer.builders import basis, planted
from tests.localizer.test_localizer import D


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
