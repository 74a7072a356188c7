"""The drift detector (gradloc/detector/drift.py) on synthetic series: healthy noise stays quiet, a climb, a
collapse and an oscillation are found with their trend and start, a one-step spike is not, a finding pages only
when its drift accelerates, drivers are the window's most extreme steps."""
from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from gradloc.config import DriftConfig
from gradloc.detector.drift import DriftDetector, Observation, _kendall, _spread
from gradloc.errors import ConfigError
from gradloc.records import PrecursorDriver, Trend

WHERE = dict(job="j", rank=0, time_unix=0.0)


def run(values: dict[tuple[str, str], np.ndarray], cfg: DriftConfig | None = None, drivers: bool = False):
    det = DriftDetector(cfg or DriftConfig())
    n = len(next(iter(values.values())))
    found = []
    for s in range(n):
        obs = [Observation(statistic=k, layer=layer, value=float(v[s]),
                           driver=PrecursorDriver(step=s, value=float(v[s]), micro_batch=0, sample=s % 4,
                                                  position=s % 7, sample_id=f"s{s}") if drivers else None)
               for (k, layer), v in values.items()]
        found += det.observe(s, obs, WHERE)
    return found


def noisy(rng: np.random.Generator, n: int, level: float = 10.0, noise: float = 0.05, ar: float = 0.9) -> np.ndarray:
    """A healthy statistic: a level with AR(1) log-noise of stationary spread ``noise``."""
    e = np.zeros(n)
    for i in range(1, n):
        e[i] = ar * e[i - 1] + rng.normal(0.0, noise * math.sqrt(1 - ar * ar))
    return level * np.exp(e)


def test_healthy_noise_makes_no_finding():
    rng = np.random.default_rng(0)
    series = {(k, f"layers.{i}"): noisy(rng, 5000, level=1.0 + i, noise=0.02 + 0.03 * i)
              for i, k in itertools.product(range(3), ("attn_max_logit", "attn_entropy"))}
    assert run(series) == []


def test_a_climb_is_found_with_its_start_and_layer():
    rng = np.random.default_rng(1)
    x = noisy(rng, 3000)
    x[1500:] *= np.exp(np.arange(1500) * 0.004)  # ×1.5 after ~100 steps, ×400 by the end
    found = run({("attn_max_logit", "layers.1"): x, ("attn_max_logit", "layers.0"): noisy(rng, 3000)})
    assert len(found) == 1, found
    f = found[0]
    assert (f.statistic, f.layer, f.trend) == ("attn_max_logit", "layers.1", Trend.RISING)
    assert 1500 < f.step <= 1800 and 1500 <= f.since_step <= f.step and not f.pages
    assert f.change >= 1.5 and f.z >= 6 and f.rate > 0 and "rising" in f.detail


def test_an_entropy_collapse_is_a_falling_finding():
    rng = np.random.default_rng(2)
    x = noisy(rng, 3000, level=1.5)
    x[1200:] *= np.exp(-np.arange(1800) * 0.005)
    found = run({("attn_entropy", "layers.1"): x})
    assert [f.trend for f in found] == [Trend.FALLING]
    assert 1200 < found[0].step <= 1500 and found[0].value < found[0].baseline


def test_rising_entropy_is_not_a_danger():
    rng = np.random.default_rng(3)
    x = noisy(rng, 3000, level=0.5)
    x[1200:] *= np.exp(np.arange(1800) * 0.002)
    assert run({("attn_entropy", "layers.0"): x}) == []


def test_oscillation_without_a_trend():
    rng = np.random.default_rng(4)
    x = noisy(rng, 3000, noise=0.01)
    x[1500:] *= np.exp(0.3 * np.where(np.arange(1500) % 2 == 0, 1.0, -1.0))  # swings ±30% step to step
    found = run({("logit_max_abs", "lm_head"): x})
    assert [f.trend for f in found] == [Trend.OSCILLATING]
    assert 1500 < found[0].step <= 1600


def test_dead_experts_are_judged_by_their_level_not_their_swings():
    """A count of a few integers (experts no token reached) that starts flipping 0 ↔ 1 after a quiet reference is
    routing noise (BENCHMARKS §8's MoE controls): no oscillation finding, where a continuous statistic with the same
    log-scale swings makes one; experts dying and staying dead is still a rising finding."""
    flips = np.zeros(3000)
    flips[1500:] = np.arange(1500) % 2  # 0, 1, 0, 1...
    assert run({("dead_experts", "layers.1.mlp.gate"): flips}) == []
    assert [f.trend for f in run({("expert_load_max", "layers.1.mlp.gate"): 1.0 + flips})] == [Trend.OSCILLATING]
    dying = np.zeros(3000)
    dying[1500:] = np.minimum(np.arange(1500) // 100, 6)  # one more dead expert every 100 steps, up to 6
    found = run({("dead_experts", "layers.1.mlp.gate"): dying})
    assert [f.trend for f in found] == [Trend.RISING] and 1500 < found[0].step <= 1900


def test_a_one_step_spike_is_not_a_drift():
    rng = np.random.default_rng(5)
    x = noisy(rng, 3000)
    x[2000] *= 50
    x[2500:2503] *= 20
    assert run({("attn_max_logit", "layers.0"): x}) == []


def test_nothing_during_the_warmup():
    rng = np.random.default_rng(6)
    x = noisy(rng, 1200)
    x[400:] *= np.exp(np.arange(800) * 0.01)
    found = run({("attn_max_logit", "a"): x}, DriftConfig(warmup=1000))
    assert found and all(f.step > 1000 for f in found)
    assert run({("attn_max_logit", "a"): x[:1000]}, DriftConfig(warmup=1000)) == []


def test_one_finding_per_episode_and_it_pages_only_when_accelerating():
    rng = np.random.default_rng(7)
    steady = noisy(rng, 3000)
    steady[1000:] *= np.exp(np.arange(2000) * 0.003)  # a constant rate on the log scale: persists, never speeds up
    found = run({("attn_max_logit", "a"): steady})
    assert len(found) == 1 and not found[0].pages
    faster = noisy(rng, 3000)
    t = np.arange(2000)
    faster[1000:] *= np.exp(1e-5 * t ** 2 / 2 + 0.002 * t)  # the rate keeps growing
    found = run({("attn_max_logit", "a"): faster})
    assert [f.pages for f in found] == [False, True], found
    assert found[1].since_step == found[0].since_step and found[1].step - found[1].since_step >= 200


def test_a_series_that_settles_can_drift_again():
    rng = np.random.default_rng(8)
    x = noisy(rng, 4000)
    x[1000:1200] *= np.exp(np.arange(200) * 0.005)  # up ×2.7, then stays there
    x[1200:] *= math.exp(200 * 0.005)
    x[3000:] *= np.exp(np.arange(1000) * 0.005)  # and climbs again
    found = run({("attn_max_logit", "a"): x})
    assert [f.trend for f in found] == [Trend.RISING, Trend.RISING]
    assert 1000 < found[0].step < 1400 and 3000 < found[1].step < 3300


def test_drivers_are_the_most_extreme_steps_of_the_window():
    rng = np.random.default_rng(9)
    x = noisy(rng, 2000)
    x[1000:] *= np.exp(np.arange(1000) * 0.005)
    found = run({("attn_max_logit", "a"): x}, drivers=True)
    f = found[0]
    assert 0 < len(f.drivers) <= 8
    values = [d.value for d in f.drivers]
    assert values == sorted(values, reverse=True)
    window = x[f.step - 49:f.step + 1]
    assert values[0] == pytest.approx(window.max())
    assert all(f.step - 50 < d.step <= f.step and d.sample_id == f"s{d.step}" for d in f.drivers)
    y = noisy(rng, 2000, level=1.0)
    y[1000:] *= np.exp(-np.arange(1000) * 0.005)
    g = run({("attn_entropy", "a"): y}, drivers=True)[0]
    assert [d.value for d in g.drivers] == sorted(d.value for d in g.drivers)  # lowest entropy first


def test_a_series_measured_every_few_steps_counts_its_own_values():
    rng = np.random.default_rng(12)
    x = noisy(rng, 6000, ar=0.5)
    x[3000:] *= np.exp(np.arange(3000) * 0.002)
    x[np.arange(6000) % 4 != 0] = np.nan  # attention_every=4: a value every 4th step
    found = run({("attn_max_logit", "a"): x})
    assert [f.trend for f in found] == [Trend.RISING] and 3000 < found[0].step < 3800


def test_series_beyond_the_bound_are_counted_not_judged():
    drops: Counter[str] = Counter()
    det = DriftDetector(DriftConfig(max_series=2), on_drop=lambda name: drops.update([name]))
    det.observe(0, [Observation(statistic="attn_max_logit", layer=str(i), value=1.0) for i in range(5)], WHERE)
    assert len(det.series) == 2 and drops["drift_series_dropped"] == 3


def test_statistics_filter_and_non_finite_values():
    rng = np.random.default_rng(10)
    x = noisy(rng, 2000)
    x[1000:] *= np.exp(np.arange(1000) * 0.005)
    x[1500:1510] = np.nan
    assert run({("attn_max_logit", "a"): x}, DriftConfig(statistics=("attn_entropy",))) == []
    assert len(run({("attn_max_logit", "a"): x})) == 1


def test_config_is_validated():
    for bad in (dict(window=4), dict(reference=60, window=50), dict(min_change=1.0), dict(tau=1.0),
                dict(statistics=("loss",)), dict(patience=0), dict(warmup=-1), dict(enabled=1),
                dict(references=(("loss", 900),)), dict(references=(("attn_entropy", 60),)),
                dict(references=(("attn_entropy", 900), ("attn_entropy", 600))),
                dict(references={"attn_entropy": "900"}),
                dict(references=(("attn_entropy", 900.0),))):
        with pytest.raises(ConfigError):
            DriftConfig(**bad)


def test_references_and_statistics_from_a_dict_or_lists():
    """A YAML or JSON config (an integration's ``gradloc=`` dict) gives lists and dicts, taken as the tuples."""
    from gradloc.integrations.loop import as_config

    cfg = as_config({"precursors": {"drift": {"references": {"router_entropy": 1200},
                                              "statistics": ["router_entropy"]}}})
    drift = cfg.precursors.drift
    assert drift.references == (("router_entropy", 1200),) and drift.statistics == ("router_entropy",)
    assert drift.reference_of("router_entropy") == 1200 and drift.reference_of("attn_entropy") == drift.reference
    assert DriftConfig(references=[["attn_entropy", 600], ("rl_entropy", 700)]).references == (
        ("attn_entropy", 600), ("rl_entropy", 700))
    assert DriftConfig(references={}).references == ()


def test_the_config_knows_every_statistic():
    from gradloc.config import precursors as config
    from gradloc.records import precursors as records

    assert config.STATISTICS == records.STATISTICS


def test_kendall_and_spread_match_brute_force():
    rng = np.random.default_rng(11)
    for n in (3, 10, 51):
        y = np.round(rng.normal(size=n), 1)  # ties included
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
        tau = sum(np.sign(y[j] - y[i]) for i, j in pairs) / len(pairs)
        assert _kendall(y) == pytest.approx(tau)
        d = np.diff(y)
        assert _spread(y) == pytest.approx(max(1.4826 * np.median(np.abs(d - np.median(d))) / math.sqrt(2), 0.01))


def test_an_entropy_falling_slowly_is_held_to_its_longer_reference():
    """A steady fall of ×1.25 per 175 steps (the router collapse of docs/BENCHMARKS.md §8's seed study): against the
    300 values before the window the gap stays at ×1.25 for ever, under min_change; held to its last 900 values (the
    entropies' default ``references``) it is found, falling, ~400 steps in. The longer reference is the entropies'
    only: the same fall mirrored on a rising statistic is judged against 300 values."""
    rng = np.random.default_rng(3)
    x = noisy(rng, 3200, level=1.0, noise=0.02)
    x[1200:] *= np.exp(-math.log(1.25) / 175 * np.arange(2000))  # ×0.8 every 175 steps from step 1200
    key = ("router_entropy", "layers.0.router")
    assert DriftConfig().reference_of("router_entropy") == 900 and DriftConfig().reference_of("attn_max_logit") == 300
    assert run({key: x}, DriftConfig(references=())) == []
    found = run({key: x})
    assert len(found) == 1, found
    f = found[0]
    assert (f.statistic, f.trend) == ("router_entropy", Trend.FALLING) and 1300 < f.since_step < 1700, f
    assert f.change <= 1 / 1.5 and "falling" in f.detail
    assert run({("attn_max_logit", "layers.0"): 1.0 / x}) == []  # rising, reference 300: not found
    assert len(run({("attn_max_logit", "layers.0"): 1.0 / x},
                   DriftConfig(references=(("attn_max_logit", 900),)))) == 1  # its own longer reference: found


def test_a_longer_reference_judges_the_level_not_the_swings():
    """Step-to-step swings growing with a ramping LR (×10 over 600 steps, no change of level): against the spread of
    the last ``reference`` (300) values they grow ×2 at most — no oscillation — whatever the statistic's own longer
    reference; measured against its 900 values (mostly of the calmer era) they would be ×6 and an oscillation."""
    rng = np.random.default_rng(5)
    amp = 0.005 * 10 ** (np.clip(np.arange(3000) - 1500, 0, 600) / 600)  # the log-noise's spread per step
    x = np.exp(rng.normal(0.0, 1.0, 3000) * amp)
    assert DriftConfig().reference_of("attn_entropy") == 900
    assert run({("attn_entropy", "layers.0"): x}) == []
    assert run({("attn_entropy", "layers.0"): x}, DriftConfig(references=())) == []
