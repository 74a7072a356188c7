"""SpikeDetector on hand-built StepRecords; config validation."""
from __future__ import annotations

import math

import numpy as np
import pytest

import gradloc
from gradloc.config import DetectorConfig, LocalizerConfig, WatchConfig
from gradloc.detector import INCIDENT, LOCALIZE, SpikeDetector, opens_incident
from gradloc.records import LayerStats, StepRecord

LAYERS = ["a", "b", "c"]
LAYER_SCALE = {"a": 0.8, "b": 0.05, "c": 0.5}


def record(step: int, g: float, loss: float | None = 2.0, layers: dict[str, float] | None = None,
           **kw) -> StepRecord:
    stats = tuple(LayerStats(layer=name, grad_norm=v, grad_max_abs=v, nonfinite=0, param_norm=10.0, numel=100)
                  for name, v in (layers or {}).items())
    return StepRecord(job="job", rank=0, step=step, time_unix=0.0, global_norm=g, loss=loss, micro_batches=1,
                      layers=stats, **kw)


class Run:
    """Feeds a detector healthy steps (norm ≈ 1 ± 5 %, loss ≈ 2 ± 1 %, layers ≈ their scale ± 5 %)."""

    def __init__(self, cfg: DetectorConfig | None = None, layers: list[str] | None = None, seed: int = 0) -> None:
        self.cfg = cfg or DetectorConfig(warmup=10)
        self.det = SpikeDetector(self.cfg, layers or [])
        self.rng = np.random.default_rng(seed)
        self.step = 0
        self.layers = layers or []

    def healthy_values(self):
        g = 1.0 + 0.05 * self.rng.standard_normal()
        loss = 2.0 + 0.02 * self.rng.standard_normal()
        lay = {n: LAYER_SCALE[n] * (1 + 0.05 * self.rng.standard_normal()) for n in self.layers}
        return g, loss, lay

    def observe(self, g=None, loss="healthy", layers=None, **kw):
        hg, hl, hlay = self.healthy_values()
        ev = self.det.observe(record(self.step, hg if g is None else g, hl if loss == "healthy" else loss,
                                     hlay if layers is None else {**hlay, **layers}, **kw))
        self.step += 1
        return ev

    def healthy(self, n: int):
        return [self.observe() for _ in range(n)]


def test_warmup_reports_an_outlier_as_warmup_spike_and_opens_no_incident():
    run = Run(DetectorConfig(warmup=10), LAYERS)
    events = run.healthy(4) + [run.observe(g=50.0, loss=40.0, layers={"b": 30.0})]
    band = run.det.band(events[4])  # the record shows the warm-up line the step crossed
    events += run.healthy(5)
    # issue 32: a real early spike used to be dropped; now it is reported on its step (no incident)
    assert [e.kinds for e in events] == [()] * 4 + [("warmup_spike",)] + [()] * 5
    assert not any(opens_incident(e) for e in events)
    assert all(e.z is None and e.loss_z is None and e.layers == () for e in events)  # judged against nothing
    assert all(e.mean is None for e in events[:9])  # the 10th sample completes the warm-up
    assert band["norm_mean"] == pytest.approx(1.0, abs=0.15) and band["norm_threshold"] == 3.0 * band["norm_mean"]
    assert run.det.healthy_norm() is not None  # ready right after the 10th sample
    assert run.det.healthy_norm() == pytest.approx(1.0, abs=0.1)  # the spike did not enter the level
    after = run.observe()
    assert after.mean is not None and after.z is not None and abs(after.z) < 3


def test_planted_10x_spike_is_flagged_with_its_z():
    run = Run(DetectorConfig(warmup=10))
    assert not any(e.kinds for e in run.healthy(30))
    mean = run.det.healthy_norm()
    assert mean == pytest.approx(1.0, abs=0.1)
    ev = run.observe(g=10.0 * mean)
    assert ev.kinds == ("grad_spike",)
    assert ev.is_spike and "grad_spike" in LOCALIZE
    assert ev.z is not None and ev.z > run.cfg.z_threshold
    assert ev.global_norm == pytest.approx(10.0 * mean)


def test_single_spike_does_not_inflate_the_statistics():
    run = Run(DetectorConfig(warmup=10))
    run.healthy(30)
    mean_before = run.det.healthy_norm()
    std_before = float(run.det._global.std[0])
    lag = float(run.det._global.lag[0])
    assert run.observe(g=10.0 * mean_before).kinds == ("grad_spike",)
    mean_after = run.det.healthy_norm()
    # the spike entered the EMA clamped to μ + lag + z_thr·σ, not at 10 μ
    bound = mean_before + (1 - run.cfg.alpha) * (lag + run.cfg.z_threshold * std_before)
    assert mean_after <= bound + 1e-12
    assert mean_after < 1.01 * mean_before
    nxt = run.observe(g=mean_before)
    assert nxt.kinds == () and abs(nxt.z) < 1.0
    assert not any(e.kinds for e in run.healthy(10))


def test_repeated_spikes_are_each_flagged():
    run = Run(DetectorConfig(warmup=10))
    run.healthy(20)
    mean = run.det.healthy_norm()
    flags = [run.observe(g=10.0 * mean).kinds for _ in range(3)]
    assert flags == [("grad_spike",)] * 3


def test_abs_threshold_fires_even_during_warmup():
    run = Run(DetectorConfig(warmup=10, abs_threshold=5.0))
    assert run.observe(g=4.9).kinds == ()
    ev = run.observe(g=6.0)
    assert ev.kinds == ("abs_threshold",) and ev.z is None  # warm-up: no z yet, the absolute rule still applies
    assert "abs_threshold" in LOCALIZE
    run.healthy(20)
    assert set(run.observe(g=60.0).kinds) == {"grad_spike", "abs_threshold"}


def test_nonfinite_loss():
    run = Run(DetectorConfig(warmup=10))
    run.healthy(15)
    loss_mean = float(run.det._loss.mean[0])
    for bad in (float("nan"), float("inf")):
        ev = run.observe(loss=bad)
        assert "nonfinite_loss" in ev.kinds and ev.loss_z is None
    assert float(run.det._loss.mean[0]) == loss_mean  # not folded into the loss statistics
    assert run.observe().kinds == ()


def test_nonfinite_loss_during_warmup_is_flagged():
    run = Run(DetectorConfig(warmup=10))
    assert run.observe(loss=float("nan")).kinds == ("nonfinite_loss",)


@pytest.mark.parametrize("g,nonfinite", [(float("nan"), 7), (float("inf"), 1), (1.0, 3)])
def test_nonfinite_grad(g, nonfinite):
    run = Run(DetectorConfig(warmup=10))
    run.healthy(15)
    mean, var = run.det.healthy_norm(), float(run.det._global.var[0])
    ev = run.observe(g=g, nonfinite=nonfinite)
    assert "nonfinite_grad" in ev.kinds and "nonfinite_grad" in LOCALIZE
    assert "skipped_step" not in ev.kinds
    if not math.isfinite(g):
        assert ev.z is None and "grad_spike" not in ev.kinds
        assert run.det.healthy_norm() == mean and float(run.det._global.var[0]) == var  # stats untouched
    assert run.observe().kinds == ()


def test_nonfinite_grad_during_warmup_is_flagged_and_not_counted():
    run = Run(DetectorConfig(warmup=3))
    assert run.observe(g=float("nan"), nonfinite=2).kinds == ("nonfinite_grad",)
    run.healthy(2)
    assert run.det.healthy_norm() is None  # the NaN step did not count as a warm-up sample
    run.healthy(1)
    assert run.det.healthy_norm() is not None


def test_loss_spike():
    run = Run(DetectorConfig(warmup=10))
    run.healthy(20)
    ev = run.observe(loss=20.0)
    assert ev.kinds == ("loss_spike",) and "loss_spike" in LOCALIZE
    assert ev.loss_z is not None and ev.loss_z > run.det.config.loss_z_threshold
    assert run.observe(loss=0.5).kinds == ()  # a sudden *drop* in loss is not a spike
    assert run.observe().kinds == ()


def test_sustained_upward_trend_is_flagged_as_divergence():
    run = Run(DetectorConfig(warmup=10, divergence_patience=5))
    run.healthy(30)
    g, kinds = 1.0, []
    for _ in range(60):
        g *= 1.04
        kinds.append(run.observe(g=g).kinds)
    first = next(i for i, k in enumerate(kinds) if "divergence" in k)
    assert first >= run.cfg.divergence_patience  # needs `patience` rising steps in a row
    assert sum("divergence" in k for k in kinds) >= 3  # re-armed after each report
    assert "divergence" not in LOCALIZE  # a trend, not a token event


def test_no_divergence_on_a_flat_noisy_run():
    run = Run(DetectorConfig(warmup=10, divergence_patience=5))
    assert not any("divergence" in e.kinds for e in run.healthy(300))


def test_per_layer_spike_names_the_layer():
    run = Run(DetectorConfig(warmup=10), LAYERS)
    assert not any(e.kinds for e in run.healthy(30))
    ev = run.observe(layers={"b": 50 * LAYER_SCALE["b"]})  # global norm stays healthy
    assert ev.kinds == ("layer_spike",)
    # a layer alone is reported on the step but opens no incident (noisy in small layers)
    assert "layer_spike" not in LOCALIZE and "layer_spike" not in INCIDENT
    assert ev.layers == ("b",)
    ev2 = run.observe(layers={"c": 100 * LAYER_SCALE["c"], "b": 20 * LAYER_SCALE["b"]})
    assert ev2.layers == ("c", "b")  # hottest first
    assert run.observe().kinds == ()


def test_layer_missing_from_a_record_is_not_a_spike():
    run = Run(DetectorConfig(warmup=5), LAYERS)
    run.healthy(10)
    g, loss, lay = run.healthy_values()
    lay.pop("a")
    ev = run.det.observe(record(run.step, g, loss, lay))
    assert ev.kinds == () and ev.layers == ()


def test_skipped_step():
    run = Run(DetectorConfig(warmup=10), LAYERS)
    run.healthy(15)
    mean = run.det.healthy_norm()
    layer_mean = run.det._layers.mean.copy()
    ev = run.observe(g=float("nan"), skipped=True, nonfinite=5, layers={"a": float("nan")})
    assert ev.kinds == ("skipped_step",)  # GradScaler skips it: not reported as nonfinite_grad
    assert "skipped_step" not in LOCALIZE and ev.layers == ()
    assert run.det.healthy_norm() == mean
    np.testing.assert_array_equal(run.det._layers.mean, layer_mean)
    assert run.observe().kinds == ()


def test_skipped_steps_do_not_count_towards_warmup():
    run = Run(DetectorConfig(warmup=3))
    for _ in range(3):
        assert run.observe(g=1e4, skipped=True).kinds == ("skipped_step",)
    assert run.det.healthy_norm() is None


# -- config validation -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,keyword", [
    (dict(warmup=1), "warmup"),
    (dict(alpha=0.0), "alpha"),
    (dict(alpha=1.0), "alpha"),
    (dict(alpha=float("nan")), "alpha"),
    (dict(z_threshold=0), "z_threshold"),
    (dict(layer_z_threshold=-1.0), "layer_z_threshold"),
    (dict(loss_z_threshold=float("nan")), "loss_z_threshold"),
    (dict(abs_threshold=0.0), "abs_threshold"),
    (dict(abs_threshold=-3.0), "abs_threshold"),
    (dict(divergence_patience=0), "divergence_patience"),
    (dict(divergence_margin=0.0), "divergence_margin"),
    (dict(min_std_fraction=1.0), "min_std_fraction"),
    (dict(min_std_fraction=-0.1), "min_std_fraction"),
    (dict(warmup_ratio=1.0), "warmup_ratio"),
])
def test_detector_config_validation(kwargs, keyword):
    with pytest.raises(gradloc.ConfigError, match=keyword):
        DetectorConfig(**kwargs)


@pytest.mark.parametrize("kwargs,keyword", [
    (dict(max_probes=0), "max_probes"),
    (dict(min_explained_share=0.0), "min_explained_share"),
    (dict(min_explained_share=1.5), "min_explained_share"),
    (dict(max_candidates=0), "max_candidates"),
    (dict(candidate_rel_score=0.0), "candidate_rel_score"),
    (dict(candidate_rel_score=2.0), "candidate_rel_score"),
    (dict(candidate_outlier_factor=0.5), "candidate_outlier_factor"),
    (dict(bisection_budget=0), "bisection_budget"),
    (dict(bisection_sigma=0.0), "bisection_sigma"),
    (dict(context_tokens=-1), "context_tokens"),
])
def test_localizer_config_validation(kwargs, keyword):
    with pytest.raises(gradloc.ConfigError, match=keyword):
        LocalizerConfig(**kwargs)


@pytest.mark.parametrize("kwargs,keyword", [
    (dict(job=""), "job"),
    (dict(job=None), "job"),
    (dict(rank=-1), "rank"),
    (dict(top_k=0), "top_k"),
    (dict(rank=2, world_size=2), "world_size"),
    (dict(world_size=0), "world_size"),
    (dict(agent="localhost"), "agent"),
    (dict(metrics_address="127.0.0.1:http"), "metrics_address"),
    (dict(layer_grouping="layers"), "layer_grouping"),
    (dict(layer_grouping=0), "layer_grouping"),
    (dict(detector={"warmup": 5}), "DetectorConfig"),
    (dict(localizer=DetectorConfig()), "LocalizerConfig"),
])
def test_watch_config_validation(kwargs, keyword):
    with pytest.raises(gradloc.ConfigError, match=keyword):
        WatchConfig(**kwargs)


def test_config_error_is_a_value_error_and_valid_configs_construct():
    assert issubclass(gradloc.ConfigError, ValueError) and issubclass(gradloc.ConfigError, gradloc.GradlocError)
    cfg = WatchConfig(job="j", rank=3, world_size=4, top_k=1, layer_grouping=2,
                      detector=DetectorConfig(warmup=2, abs_threshold=1.0), localizer=LocalizerConfig(max_probes=1))
    assert cfg.detector.warmup == 2 and cfg.localizer.max_probes == 1
    assert WatchConfig(layer_grouping=lambda name: name.split(".")[0]).layer_grouping("a.b") == "a"
