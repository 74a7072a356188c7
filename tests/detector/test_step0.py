"""A detector for real runs from step 0 (issue 32): early spikes and the fall of early training do
not inflate σ, a spike in the warm-up is reported, and a later 2.5-3× spike is caught."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gradloc.config import DetectorConfig
from gradloc.detector import SpikeDetector, opens_incident
from gradloc.detector.ema import EmaZ, ZClipEma
from gradloc.records import StepRecord

WARMUP = 25


def trending(n: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(norms, true σ per step): a norm falling linearly from 3 to 1 with 5 % Gaussian noise, and two
    real early spikes at steps 13 and 21 (8×, inside the warm-up), as in the issue's run."""
    rng = np.random.default_rng(seed)
    level = 3.0 - 2.0 * np.arange(n) / n
    g = level * (1 + 0.05 * rng.standard_normal(n))
    g[[13, 21]] *= 8
    return g, 0.05 * level


def record(step: int, g: float) -> StepRecord:
    return StepRecord(job="job", rank=0, step=step, time_unix=0.0, global_norm=g, loss=2.0, micro_batches=1,
                      layers=())


def stds(cls, g: np.ndarray) -> np.ndarray:
    e = cls(1, WARMUP, 0.97, 0.02)
    out = []
    for x in g:
        out.append(float(e.std[0]) if e.ready[0] else np.nan)
        e.update(np.array([x]), 2.5)
    return np.array(out)


def test_sigma_tracks_the_healthy_spread_within_50_steps_of_the_warm_up():
    for seed in range(3):
        g, true = trending(seed=seed)
        ratio = stds(EmaZ, g)[WARMUP + 50:] / true[WARMUP + 50:]
        assert 0.67 < ratio.min() and ratio.max() < 1.5, (seed, ratio.min(), ratio.max())
        old = stds(ZClipEma, g)[WARMUP + 50] / true[WARMUP + 50]
        assert old > 10, old  # ZClip's plain warm-up variance took the spikes in


@pytest.mark.parametrize("k", [2.8, 3.0])
def test_a_later_2_5_to_3x_spike_is_caught_where_the_old_statistics_missed_it(k):
    g, _ = trending()
    g[60] *= k  # 35 steps after the warm-up
    found = {}
    for name in ("default", "zclip"):
        det = SpikeDetector(DetectorConfig(sensitivity=name), [])
        events = [det.observe(record(s, float(x))) for s, x in enumerate(g)]
        found[name] = [e.step for e in events if e.step >= WARMUP and opens_incident(e)]
    assert found["default"] == [60], found
    assert 60 not in found["zclip"], found  # σ inflated by the warm-up: z of a 3× step below 2.5


def test_a_spike_in_the_warm_up_is_reported_and_does_not_poison_the_statistics():
    g, _ = trending()
    det = SpikeDetector(DetectorConfig(), [])
    events, bands = [], []
    for s, x in enumerate(g[:WARMUP + 5]):
        events.append(det.observe(record(s, float(x))))
        bands.append(det.band(events[-1]))
    assert [e.step for e in events if "warmup_spike" in e.kinds] == [13, 21]
    assert not any(opens_incident(e) for e in events)  # a finding on the step, no incident
    for s in (13, 21):  # the record's band is the warm-up line the step crossed
        assert bands[s]["norm_mean"] == pytest.approx(3.0 - 2.0 * s / 300, rel=0.1)
        assert g[s] > bands[s]["norm_threshold"] == pytest.approx(3.0 * bands[s]["norm_mean"])
    assert det.healthy_norm() == pytest.approx(3.0 - 2.0 * WARMUP / 300, rel=0.05)
    assert float(det._global.std[0]) < 2 * 0.05 * 3.0


def test_zclip_sensitivity_keeps_the_old_statistics_and_reports_no_warm_up_spike():
    g, _ = trending()
    det = SpikeDetector(DetectorConfig(sensitivity="zclip"), [])
    events = [det.observe(record(s, float(x))) for s, x in enumerate(g[:WARMUP])]
    assert not any(e.kinds for e in events)
    assert isinstance(det._global, ZClipEma)
    assert det.healthy_norm() == pytest.approx(float(np.mean(g[:WARMUP])))


# -- a real run ----------------------------------------------------------------------------------------
# two real spikes inside the warm-up, as in the run (steps 13 and 21), then faults after step 100
EARLY = {13: "scaled", 21: "scaled"}
FAULTS = {130: "padded_batch", 170: "token", 210: "padded_batch", 250: "token"}


@pytest.mark.skipif(not Path("/usr/share/common-licenses").is_dir(), reason="no licence texts")
def test_a_real_run_from_initialisation_catches_faults_after_step_100_without_false_incidents():
    """The issue's loop (byte-level GPT-2, dropout, licence texts, 4 micro-batches, warm-up + cosine,
    clip 1.0), trained from initialisation with two real spikes in the warm-up (steps 13 and 21: one
    micro-batch's loss ×20, ~8×): both are reported (``warmup_spike``, no incident), and each fault
    planted after step 100 (a micro-batch of unmasked padding, a high-weight token) opens an
    incident. The statistics before issue 32 had σ 1.0 at step 100 and 0.52 at step 150 here and
    missed the padding at step 130 (4.3× its mean). Per-sample findings off: their calibration on
    licence text is another part of issue 32. A single padded row moves this model's norm only
    1.1-1.5× (no norm rule can call it), so the padding fault is a padded micro-batch."""
    pytest.importorskip("transformers")
    from tests.detector import real_run as rr

    reports = rr.train(rr.LoopConfig(steps=280), {**EARLY, **FAULTS}, samples=False)
    assert [r.record.step for r in reports if "warmup_spike" in r.spike.kinds] == sorted(EARLY)
    opened = [r.record.step for r in reports if r.incident is not None]
    assert all(s >= 25 for s in opened)  # nothing opened in the warm-up
    for s in FAULTS:
        assert s in opened, (s, FAULTS[s], opened)
    # 180 steps cannot measure "<= 1 per 1,000" (docs/BENCHMARKS.md §5 does): at most one incident
    # from step 100 on that is no planted fault, and a real spike at that (>= 2.5x the healthy median)
    norms = np.array([r.record.global_norm for r in reports[100:] if r.record.step not in FAULTS])
    false = [r for r in reports[100:] if r.incident is not None and r.record.step not in FAULTS]
    assert len(false) <= 1, [r.record.step for r in false]
    assert all(r.record.global_norm >= 2.5 * np.median(norms) for r in false)
