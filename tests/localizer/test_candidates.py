"""The job's candidates from one rank's picture (picture.py): outliers by relative and median
thresholds, best first, eligible only; non-finite scores are flagged (the localizer names their
positions instead, before any candidate)."""
from __future__ import annotations

import numpy as np

from gradloc.collector.batch import make_meta
from gradloc.config import LocalizerConfig
from gradloc.localizer.picture import Picture, summary
from gradloc.localizer.token_view import TokenView

CFG = LocalizerConfig()  # candidate_rel_score 0.1, candidate_outlier_factor 20, max_candidates 32


def picture(scores, eligible=None, cfg: LocalizerConfig = CFG) -> Picture:
    s = np.asarray(scores, dtype=np.float64)
    e = np.ones(s.size, dtype=bool) if eligible is None else np.asarray(eligible, dtype=bool)
    view = TokenView((), (make_meta(0, None, None, None, (1, max(s.size, 1))),), (0, s.size), s, None, e, 0.0)
    return Picture(rows=summary(view, cfg.max_candidates, True)[None].numpy(), K=cfg.max_candidates)  # (1, 3K + 5)


def pick(scores, eligible=None, cfg: LocalizerConfig = CFG) -> list[int]:
    pic = picture(scores, eligible, cfg)
    if pic.nonfinite:
        return ["non-finite"]
    return [c.flat for c in pic.candidates(cfg.candidate_rel_score, cfg.candidate_outlier_factor)]


def test_all_zero_and_empty_scores_give_no_candidates() -> None:
    assert pick(np.zeros(16)) == []
    assert pick([]) == []
    assert pick(np.zeros(4), np.zeros(4)) == []


def test_both_thresholds_apply_and_candidates_come_best_first() -> None:
    s = np.ones(40)
    s[[3, 9, 17, 30]] = [150.0, 1000.0, 90.0, 400.0]  # 90 < 0.1 × 1000
    assert pick(s) == [9, 30, 3]
    s[[9, 30]] = [1.0, 1.0]
    s[3], s[17] = 19.0, 15.0  # the top (19) is under 20 × the median (1)
    assert pick(s) == []


def test_ties_keep_flat_order() -> None:
    s = np.ones(30)
    s[[20, 4, 11]] = 500.0
    assert pick(s) == [4, 11, 20]


def test_non_finite_scores_are_flagged_before_any_candidate() -> None:
    s = np.ones(20)
    s[[0, 5, 12]] = [1e9, np.nan, np.inf]
    assert pick(s) == ["non-finite"]  # the finite outlier waits for a finite step
    assert picture(s).rows[0, 3 * CFG.max_candidates + 1] == 2  # two non-finite positions counted


def test_max_candidates_keeps_the_best() -> None:
    s = np.ones(50)
    s[[1, 2, 3, 4, 5]] = [300.0, 500.0, 400.0, 100.0, 200.0]
    assert pick(s, cfg=LocalizerConfig(max_candidates=3)) == [2, 3, 1]


def test_ineligible_positions_are_never_chosen_nor_counted_in_the_median() -> None:
    s = np.concatenate([np.full(10, 10.0), [150.0], np.zeros(30)])
    eligible = np.concatenate([np.ones(11, bool), np.zeros(30, bool)])
    # over eligible positions the median is 10, so 150 < 20 × 10 is no outlier (the zeros would make it one)
    assert pick(s, eligible) == []
    s2 = np.ones(20)
    s2[[2, 7]] = [1e6, 500.0]
    e2 = np.ones(20, bool)
    e2[2] = False
    assert pick(s2, e2) == [7]
    s2[4] = np.nan
    e2[4] = False
    assert pick(s2, e2) == [7]  # a non-finite score without a loss term is not flagged either
