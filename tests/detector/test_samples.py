"""The host-side judges of per-sample findings (gradloc/detector/samples.py), on synthetic packs."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gradloc.collector.batch import make_meta
from gradloc.collector.surprise import MB_JUDGED, MB_NOT_CE
from gradloc.config import SampleConfig
from gradloc.detector.samples import MismatchJudge, SampleJudge
from gradloc.errors import ConfigError
from gradloc.records import SAMPLE_Z_BUCKETS, RLStats

B, T = 8, 64
WHERE = dict(job="j", rank=0, step=5, time_unix=1.7e9)


def _metas(m: int = 2):
    ids = torch.arange(B * T).reshape(B, T) % 50
    return [make_meta(i, ids, None, [f"u{i}-{b}" for b in range(B)], None) for i in range(m)]


def _host(scores, n=None, codes=None, window=None, wstart=None, nonfinite=None, deficit=None,
          spread=0.01, shift=None) -> np.ndarray:
    """A step's pack (collector/surprise.py); ``deficit``: the mean calibration deficit (default: not read, NaN);
    ``spread``: each position's bound on the variance of p(y) under the model (Σ v = spread · n); ``shift``: the
    per-offset rows (gains (2K, S), paired t (2K, S)) of collector/surprise.py (default: none read)."""
    scores = np.asarray(scores, dtype=np.float64)
    S = len(scores)
    n = np.full(S, float(T)) if n is None else np.asarray(n, dtype=np.float64)
    codes = np.full(S // B, float(MB_JUDGED)) if codes is None else np.asarray(codes, dtype=np.float64)
    window = scores + 0.5 if window is None else np.asarray(window, dtype=np.float64)
    wstart = np.arange(S) * T if wstart is None else np.asarray(wstart, dtype=np.float64)
    nonfinite = np.zeros(S) if nonfinite is None else np.asarray(nonfinite, dtype=np.float64)
    deficit = np.full(S, np.nan) if deficit is None else np.asarray(deficit, dtype=np.float64)
    var = np.where(np.isnan(deficit), np.nan, spread * n)
    rows = [] if shift is None else [np.asarray(shift[0], dtype=np.float64).ravel(),  # (2K, S) -> (2K·S,)
                                     np.asarray(shift[1], dtype=np.float64).ravel()]
    return np.concatenate([codes, n, scores * n, nonfinite, window, wstart, deficit * n, var, *rows])


def _warm(judge: SampleJudge, rng: np.random.Generator, steps: int, mean: float = 3.5, sd: float = 0.3):
    for _ in range(steps):
        judge.judge(_host(rng.normal(mean, sd, 2 * B)), _metas(), WHERE, None)


def test_nothing_is_judged_during_the_warm_up_then_a_garbage_sample_is_flagged():
    cfg = SampleConfig(warmup_samples=64, min_tokens=8)
    judge, rng = SampleJudge(cfg), np.random.default_rng(0)
    first = judge.judge(_host(np.r_[rng.normal(3.5, 0.3, 15), 9.0]), _metas(), WHERE, None)
    assert first.judged == 16 and first.z_counts == () and first.outliers == () and first.baseline is None
    _warm(judge, rng, 5)
    scores = rng.normal(3.5, 0.3, 16)
    scores[11] = 9.0  # micro-batch 1, sample 3: uniformly bad, so its worst window is its mean
    window = scores + 0.5
    window[11] = 9.0
    st = judge.judge(_host(scores, window=window), _metas(), WHERE, lambda ids: "/".join(map(str, ids)))
    assert st.flagged == 1 and len(st.z_counts) == len(SAMPLE_Z_BUCKETS) + 1 and sum(st.z_counts) == 16
    (o,) = st.outliers
    assert (o.kind, o.micro_batch, o.sample, o.sample_id, o.step) == ("surprise", 1, 3, "u1-3", 5)
    assert o.z == pytest.approx((9.0 - st.baseline) / 0.3, rel=0.25) and o.z == st.max_z
    assert o.start == 0 and o.end == T and o.score == 9.0 and o.text.startswith("42/43/44")  # (3·64) % 50 = 42: sample 3's ids


def test_a_corrupted_span_is_flagged_by_its_window_with_its_positions():
    cfg = SampleConfig(warmup_samples=64, min_tokens=8, window=16)
    judge, rng = SampleJudge(cfg), np.random.default_rng(1)
    _warm(judge, rng, 6)
    scores = rng.normal(3.5, 0.3, 16)
    window = scores + 0.5
    window[4] = 9.0  # sample 4 of micro-batch 0: its mean is healthy, one window is not
    wstart = np.arange(16) * T
    wstart[4] = 4 * T + 20
    st = judge.judge(_host(scores, window=window, wstart=wstart), _metas(), WHERE, None)
    (o,) = st.outliers
    assert (o.micro_batch, o.sample, o.start, o.end) == (0, 4, 20, 36) and o.score == 9.0


def test_short_samples_are_judged_with_their_own_noise_and_tiny_ones_not_at_all():
    cfg = SampleConfig(warmup_samples=64, min_tokens=8)
    judge, rng = SampleJudge(cfg), np.random.default_rng(2)
    _warm(judge, rng, 6)
    scores = rng.normal(3.5, 0.05, 16)
    scores[:2] = 5.5  # 6.7 σ above the median at full length
    n = np.full(16, float(T))
    n[0], n[2] = 16, 4  # sample 0: a quarter of the usual length (z halves); sample 2: below min_tokens
    window = scores + 0.5
    window[0] = -np.inf  # 16 loss tokens: no window with half of its positions judged
    st = judge.judge(_host(scores, n=n, window=window), _metas(), WHERE, None)
    assert [(o.micro_batch, o.sample) for o in st.outliers] == [(0, 1)]
    assert st.judged == 15 and st.unjudged == 1


def test_refused_micro_batches_and_nonfinite_samples_are_counted_not_judged():
    judge = SampleJudge(SampleConfig(warmup_samples=8))
    nonfinite = np.zeros(16)
    nonfinite[3] = 5
    st = judge.judge(_host(np.full(16, 3.0), codes=[MB_JUDGED, MB_NOT_CE], nonfinite=nonfinite), _metas(), WHERE, None)
    assert (st.judged, st.unjudged, st.nonfinite) == (7, 8, 1)


def test_a_minority_of_outliers_barely_moves_the_baseline():
    cfg = SampleConfig(warmup_samples=64, history=256)
    judge, rng = SampleJudge(cfg), np.random.default_rng(3)
    _warm(judge, rng, 8)
    before = judge.mean.robust()[0]
    for _ in range(16):
        scores = rng.normal(3.5, 0.3, 16)
        scores[:3] = 9.0  # 3 of 16 samples garbage, every step
        judge.judge(_host(scores), _metas(), WHERE, None)
    assert abs(judge.mean.robust()[0] - before) < 0.3


def _warm_text(judge: SampleJudge, rng: np.random.Generator, steps: int):
    """Healthy real text: a mean surprise of 2.5 ± 0.15 nats/token, a calibration deficit of 0 ± 0.01."""
    for _ in range(steps):
        scores = rng.normal(2.5, 0.15, 2 * B)
        judge.judge(_host(scores, deficit=rng.normal(0.0, 0.01, 2 * B)), _metas(), WHERE, None)


def test_odd_but_legit_text_is_not_flagged_while_garbage_and_shifted_labels_are_worst_first():
    """A URL-heavy sample or a groff table is as surprising as the false outliers of the text benchmark (z ≈ 8 on
    its mean, its worst window further out) but the model knew it was unsure there (deficit ≈ 0); garbage is far
    more surprising, shifted labels are wrong where the model was sure. Only they are findings, garbage first."""
    cfg = SampleConfig(warmup_samples=64, min_tokens=8)
    judge, rng = SampleJudge(cfg), np.random.default_rng(4)
    _warm_text(judge, rng, 8)
    scores, deficit = rng.normal(2.5, 0.15, 16), rng.normal(0.0, 0.01, 16)
    window = scores + 0.5
    scores[2], deficit[2], window[2] = 3.7, 0.01, 5.5  # odd but legit: a URL-heavy sample
    scores[5], deficit[5], window[5] = 3.6, 0.0, 4.2  # a groff table
    scores[9], deficit[9], window[9] = 5.8, 0.0, 6.0  # random ids: the model is lost, and far more surprised
    scores[14], deficit[14], window[14] = 3.4, 0.08, 3.9  # shifted labels: natural inputs, wrong targets
    st = judge.judge(_host(scores, window=window, deficit=deficit), _metas(), WHERE, None)
    assert [(o.micro_batch, o.sample) for o in st.outliers] == [(1, 1), (1, 6)] and st.flagged == 2
    assert st.outliers[0].z > st.outliers[1].z >= cfg.z_threshold and st.max_z == st.outliers[0].z
    assert "below the model's own" in st.outliers[1].detail and st.outliers[0].score == 5.8


def test_the_deficit_is_judged_in_units_of_its_own_spread_under_the_model():
    """The same mean deficit means little where the model spreads its bets (each p(y) varies a lot under its own
    distribution: Σ v large) and much where it is sure (Σ v small). Sample 3: a deficit 7 MADs out over
    positions of large spread, within 2 of its own spread: no finding (the mean deficit alone flagged it). Sample
    12: a smaller deficit over confident positions, 7.6 of its own spread out: a finding (the mean deficit alone
    did not reach the line, nor did its surprise)."""
    cfg = SampleConfig(warmup_samples=64, min_tokens=8)
    judge, rng = SampleJudge(cfg), np.random.default_rng(6)
    _warm_text(judge, rng, 8)
    scores, deficit = rng.normal(2.5, 0.15, 16), rng.normal(0.0, 0.01, 16)
    spread = np.full(16, 0.01)
    scores[3], deficit[3], spread[3] = 3.1, 0.07, 0.1  # hard text, the model unsure and honest about it
    scores[12], deficit[12], spread[12] = 3.1, 0.06, 0.004  # confident positions, wrong labels
    st = judge.judge(_host(scores, deficit=deficit, spread=spread), _metas(), WHERE, None)
    assert [(o.micro_batch, o.sample) for o in st.outliers] == [(1, 4)] and st.flagged == 1


def test_a_window_of_legit_text_alone_is_not_a_finding_a_bad_span_is():
    """A worst window far out (a line of ``=``, a URL) makes a finding only when its sample's calibration deficit
    is itself half-way to the line: a span of wrong labels raises it, a legit one does not."""
    cfg = SampleConfig(warmup_samples=64, min_tokens=8, window=16)
    judge, rng = SampleJudge(cfg), np.random.default_rng(5)
    _warm_text(judge, rng, 8)
    scores, deficit = rng.normal(2.5, 0.15, 16), rng.normal(0.0, 0.01, 16)
    window = scores + 0.5
    window[3] = 9.0  # a separator line: far out on its window, calibrated over the sample
    window[7], deficit[7] = 9.0, 0.04  # a span of wrong labels: the sample's deficit at z ≈ 4
    wstart = np.arange(16) * T
    wstart[7] = 7 * T + 30
    st = judge.judge(_host(scores, window=window, wstart=wstart, deficit=deficit), _metas(), WHERE, None)
    (o,) = st.outliers
    assert (o.micro_batch, o.sample, o.start, o.end, o.score) == (0, 7, 30, 46, 9.0)


def _rl(frac: float | None, tokens: int = 1000) -> RLStats:
    return RLStats(tokens=tokens, mismatch_fraction=frac)


def test_a_sustained_mismatch_is_one_finding_a_blip_is_none():
    judge = MismatchJudge(SampleConfig(rl_warmup=5, rl_patience=3))
    out = [judge.observe(_rl(0.0), WHERE) for _ in range(5)]
    assert out[-1] == (0.0, None) and out[0] == (None, None)
    assert judge.observe(_rl(0.4), WHERE)[1] is None and judge.observe(_rl(0.4), WHERE)[1] is None  # a blip of 2
    assert judge.observe(_rl(0.0), WHERE)[1] is None
    findings = [judge.observe(_rl(0.35), {**WHERE, "step": s})[1] for s in range(10, 18)]
    assert [f.step for f in findings if f is not None] == [12]
    f = findings[2]
    assert f.kind == "rl_mismatch" and f.score == 0.35 and f.baseline == 0.0 and f.micro_batch is None
    assert f.tokens == 1000 and "35.0%" in f.detail and f.z > 6
    assert judge.baseline == 0.0  # the faulty steps never entered the baseline


def test_the_mismatch_line_follows_the_runs_own_baseline():
    judge = MismatchJudge(SampleConfig(rl_warmup=3, rl_patience=1))
    for _ in range(3):
        judge.observe(_rl(0.10), WHERE)
    assert judge.observe(_rl(0.24), WHERE)[1] is None  # below 2 × 0.10 + 0.05
    assert judge.observe(_rl(0.26), WHERE)[1] is not None
    assert judge.observe(None, WHERE) == (0.10, None) and judge.observe(_rl(None), WHERE) == (0.10, None)


@pytest.mark.parametrize("bad", [dict(z_threshold=0), dict(window=1), dict(warmup_samples=5000),
                                 dict(rl_patience=0), dict(min_tokens=0), dict(max_outliers=256)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        SampleConfig(**bad)


def test_misaligned_labels_are_judged_on_the_sample_itself_and_only_over_enough_positions():
    """A sample whose labels a neighbour predicts far better (gain ≥ SHIFT_GAIN, paired t ≥ SHIFT_T) is a finding
    however ordinary its surprise, named as shifted; offset +1 (the copy prior) is not judged; a short sample
    (fewer than SHIFT_MIN_TOKENS positions: its max-over-offsets t reaches 4 by chance) is not judged for it."""
    from gradloc.collector.head_read import offsets
    from gradloc.detector.samples import SHIFT_MIN_TOKENS

    ks = list(offsets(8))
    for n, k, want in ((64, 5, [(0, 3)]), (64, 1, []), (SHIFT_MIN_TOKENS - 1, 5, [])):
        judge, rng = SampleJudge(SampleConfig(warmup_samples=64, min_tokens=8)), np.random.default_rng(3)
        _warm(judge, rng, 8)
        S = 2 * B
        gains, ts = np.full((16, S), -1.0), np.full((16, S), -5.0)
        gains[ks.index(k), 3], ts[ks.index(k), 3] = 1.2, 9.0
        st = judge.judge(_host(rng.normal(3.5, 0.3, S), n=np.full(S, float(n)), shift=(gains, ts)), _metas(),
                         WHERE, None)
        assert [(o.micro_batch, o.sample) for o in st.outliers] == want, (n, k)
        if want:
            assert "labels look shifted by +5" in st.outliers[0].detail


def test_labels_that_are_the_inputs_are_asked_about_at_offset_minus_one_alone():
    """Offset −1, named in advance (labels that are the inputs): a gain of INPUTS_GAIN with a paired t of INPUTS_T is
    a finding there — measured on bench/samples_text.py, missed labels-are-inputs samples sit at gains 0.2–0.7, t 2–4,
    where the general rule (gain ≥ 0.3, t ≥ 4 at the best of 15 offsets) says nothing; healthy samples' gain there
    never exceeded 0.22 (t 1.2). The same gain and t at any other offset stay unflagged; a gain under INPUTS_GAIN or a
    t under INPUTS_T at −1 too. And only once the model predicts one position ahead (the run's median gain at −1 at
    or below INPUTS_ARMED): an untrained model's gain at −1 is positive on every sample, and nothing is flagged."""
    from gradloc.collector.head_read import offsets
    from gradloc.detector.samples import INPUTS_ARMED, INPUTS_GAIN, INPUTS_OFFSET, INPUTS_T

    ks = list(offsets(8))
    assert INPUTS_OFFSET == -1 and INPUTS_ARMED < 0
    S = 2 * B
    cases = ((-1, 0.45, 3.0, True), (-1, 0.25, 2.2, True), (-2, 0.45, 3.0, False), (5, 0.45, 3.0, False),
             (-1, INPUTS_GAIN - 0.05, 3.0, False), (-1, 0.45, INPUTS_T - 0.5, False))
    for healthy_gain, armed in ((-1.2, True), (0.4, False)):  # a trained model; an untrained (copy/unigram) one
        for k, gain, t, flagged in cases:
            judge, rng = SampleJudge(SampleConfig(warmup_samples=64, min_tokens=8)), np.random.default_rng(3)
            rows = (np.full((16, S), healthy_gain), np.full((16, S), -8.0 if healthy_gain < 0 else 3.0))
            for _ in range(12):  # the judge's warm-up (4 steps), then 8 steps of the run's gain at −1
                judge.judge(_host(rng.normal(3.5, 0.3, S), n=np.full(S, 128.0), shift=rows), _metas(), WHERE, None)
            gains, ts = np.full((16, S), -1.2), np.full((16, S), -8.0)
            gains[ks.index(k), 3], ts[ks.index(k), 3] = gain, t
            st = judge.judge(_host(rng.normal(3.5, 0.3, S), n=np.full(S, 128.0), shift=(gains, ts)), _metas(), WHERE,
                             None)
            want = [(0, 3)] if flagged and armed else []
            assert [(o.micro_batch, o.sample) for o in st.outliers] == want, (healthy_gain, k, gain, t)
            if want:
                o = st.outliers[0]
                assert "labels look shifted by -1" in o.detail and o.z == pytest.approx(6.0 * t / INPUTS_T)
