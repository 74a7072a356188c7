"""gradloc's own cost: measured every step, exported on the record, and shed within a budget."""
from __future__ import annotations

import math

import pytest
import torch

import gradloc
from gradloc.collector.overhead import SHED_ORDER, OverheadMeter
from tests.helpers import backward_step, make_data, single_thread, tiny_gpt  # noqa: F401


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _steps(meter: OverheadMeter, clock: FakeClock, n: int, own: float, step: float) -> list[tuple]:
    """n steps: ``own`` seconds inside one gradloc section, ``step`` seconds in all (training included)."""
    out = []
    for _ in range(n):
        t = meter.begin()
        clock.t += own
        meter.end(t)
        clock.t += step - own
        out.append(meter.finish_step())
    return out


def test_ratio_is_gradloc_time_over_the_training_time_alone():
    clock = FakeClock()
    meter = OverheadMeter(None, clock=clock, alpha=0.5)
    first, *rest = _steps(meter, clock, 30, own=0.01, step=0.26)
    assert first == (pytest.approx(0.01), None, None)  # no previous end_step: no step time yet
    own, step_s, ratio = rest[-1]
    assert own == pytest.approx(0.01) and step_s == pytest.approx(0.26)
    assert ratio == pytest.approx(0.01 / 0.25)
    assert meter.level == 0  # no budget: nothing is ever shed


def test_excluded_time_is_not_the_training_step():
    clock = FakeClock()
    meter = OverheadMeter(None, clock=clock)
    _steps(meter, clock, 1, 0.0, 0.1)
    clock.t += 5.0  # a spike's localization probes
    meter.exclude(5.0)
    _, step_s, _ = _steps(meter, clock, 1, 0.01, 0.1)[0]
    assert step_s == pytest.approx(0.1)


def test_over_budget_sheds_in_order_and_restores_when_cheap_again():
    clock = FakeClock()
    meter = OverheadMeter(0.05, clock=clock, window=10, retry=30)
    _steps(meter, clock, 11, own=0.02, step=0.12)  # 20% > 5%
    assert meter.shed == SHED_ORDER[:1] == ("update_ratio",)
    _steps(meter, clock, 10, own=0.02, step=0.12)
    assert meter.shed == SHED_ORDER == ("update_ratio", "layer_breakdown")
    _steps(meter, clock, 40, own=0.02, step=0.12)
    assert meter.level == len(SHED_ORDER)  # nothing more to shed: detection is never shed
    # cheap again: the EMA decays (α 0.9) below half the budget after ~22 steps, and `retry` (30) steps
    # have passed since the last change, so one feature comes back then — not before
    levels = [(_steps(meter, clock, 1, own=0.001, step=0.12), meter.level)[1] for _ in range(40)]
    first = levels.index(1)
    assert 15 <= first <= 30 and set(levels[:first]) == {2}
    _steps(meter, clock, 11, own=0.02, step=0.12)  # the restore did not hold: shed again, and wait longer
    assert meter.level == 2 and meter.retry == 60


def _train(steps: int, **kw):
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(steps, 2)
    mon = gradloc.watch(model, opt, detector=gradloc.DetectorConfig(warmup=5), **kw)
    reports = []
    for s in range(steps):
        reports.append(mon.end_step(backward_step(model, data, s, mon), probe=data.probe(model, s)))
        opt.step()
        opt.zero_grad()
    mon.close()
    return mon, reports


def test_records_carry_the_measured_overhead():
    mon, reports = _train(6)
    recs = [r.record for r in reports]
    assert recs[0].step_s is None and recs[0].overhead is None and recs[0].overhead_s > 0
    for r in recs[1:]:
        assert r.overhead_s > 0 and r.step_s > r.overhead_s and math.isfinite(r.overhead) and r.overhead > 0
        assert r.shed == ()


def test_a_tiny_budget_sheds_update_ratios_then_the_breakdown_but_never_detection():
    mon, reports = _train(52, max_overhead=1e-9)
    hist = {r.step: r for r in mon.history}
    assert reports[5].record.shed == ()
    shed_at = [next(r.record.step for r in reports if len(r.record.shed) >= n) for n in (1, 2)]
    assert 19 <= shed_at[0] <= 21 and 39 <= shed_at[1] <= 41
    late = reports[-1].record
    assert late.shed == ("update_ratio", "layer_breakdown")
    # update ratios stop once shed: before, every layer had one within a sweep (lean: a quarter of the parameters a
    # step); after, none (the ratio of step k arrives with step k+1's record)
    sweep = mon.update_ratios.sweep_steps
    assert {s.layer for k in range(4, 4 + sweep) for s in hist[k].layers if s.update_ratio is not None} == \
        {s.layer for s in hist[4].layers}
    assert all(s.update_ratio is None for k in range(shed_at[0] + 2, shed_at[0] + 2 + sweep) for s in hist[k].layers)
    # the per-layer breakdown of the top tokens is gone, the tokens themselves are not
    assert reports[5].record.tokens.top[0].layers
    assert late.tokens.top and not late.tokens.top[0].layers
    # detection still runs on every step: every record was judged
    assert all(r.spike is not None and r.spike.step == r.record.step for r in reports)


def test_detection_and_localization_still_work_after_shedding():
    steps = 46
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(steps, 2)
    planted = data.plant(steps - 1, 1, 2, 5)
    mon = gradloc.watch(model, opt, detector=gradloc.DetectorConfig(warmup=5), max_overhead=1e-9)
    for s in range(steps):
        rep = mon.end_step(backward_step(model, data, s, mon), probe=data.probe(model, s))
        opt.step()
        opt.zero_grad()
    mon.close()
    assert rep.record.shed == ("update_ratio", "layer_breakdown")
    loc = rep.incident.localization
    assert loc.status == "located" and {(c.micro_batch, c.sample, c.position) for c in loc.culprits} == {planted}
    assert not loc.culprits[0].layers  # no breakdown: no per-layer shares, but the right token


def test_layer_breakdown_off_by_config_keeps_two_rows_per_micro_batch():
    model = tiny_gpt(0)
    data = make_data(1, 2)
    mon = gradloc.watch(model, layer_breakdown=False)
    backward_step(model, data, 0, mon)
    buf = mon._parts[-1][1]
    assert buf.scores.shape == (2, 4, data.x.shape[-1])
    mon.end_step(None)
    mon.close()


@pytest.mark.parametrize("bad", [0, -0.1])
def test_max_overhead_must_be_positive(bad):
    with pytest.raises(gradloc.ConfigError, match="max_overhead"):
        gradloc.WatchConfig(max_overhead=bad)
