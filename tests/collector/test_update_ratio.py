"""Update-to-weight ratios within a memory budget: the rotating window, its sweep, its memory."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import gradloc
from gradloc.collector.update_ratio import UpdateRatioTracker
from gradloc.config import LEAN_SWEEP_STEPS
from tests.helpers import backward_step, make_data, single_thread, tiny_gpt  # noqa: F401

CPU = torch.device("cpu")


def _params(*shapes: tuple[int, ...], dtype=torch.float32) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(*s, generator=g, dtype=dtype)) for s in shapes]


def test_windows_cover_every_element_exactly_once_per_sweep():
    params = _params((7, 5), (3,), (11, 2), (4,), dtype=torch.float32)
    group_of = [0, 0, 1, 2]
    tracker = UpdateRatioTracker(params, group_of, 3, window_bytes=4 * 9, primary=CPU)  # 9 floats a step
    total = sum(p.numel() for p in params)
    assert math.ceil(total / 9) <= tracker.sweep_steps <= math.ceil(total / 9) + 1 and not tracker.full
    seen = [np.zeros(p.numel(), dtype=int) for p in params]
    for _ in range(tracker.sweep_steps):
        w = tracker._next_window()
        assert sum(pc.count * 4 for pc in w.pieces) <= 4 * 9
        for pc in w.pieces:
            seen[pc.param][pc.start:pc.start + pc.count] += 1
        assert w.layer_elems.tolist() == [sum(pc.count for pc in w.pieces if group_of[pc.param] == g)
                                          for g in range(3)]
    assert all((s == 1).all() for s in seen), "a sweep must cover every element exactly once"
    assert tracker._cursor == (0, 0)  # the next sweep starts over


def test_a_window_smaller_than_one_element_still_moves_on():
    params = _params((4,), dtype=torch.float64)
    tracker = UpdateRatioTracker(params, [0], 1, window_bytes=3, primary=CPU)
    covered = [tracker._next_window().pieces[0].start for _ in range(4)]
    assert covered == [0, 1, 2, 3]


def _sgd_step(params, lr, grads):
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= lr * g


def test_ratios_equal_the_exact_ratio_and_large_layers_are_assembled_over_a_sweep():
    """SGD with one fixed gradient and a tiny learning rate: Δθ = −lr·g every step and θ barely moves,
    so a layer assembled from chunks measured at consecutive steps must equal the one-step ratio."""
    params = _params((64, 8), (8,), (3, 3), dtype=torch.float64)  # layer 0 (520 elements) > the window
    group_of = [0, 0, 1]
    grads = [torch.randn_like(p) for p in params]
    lr = 1e-6
    window = 8 * 200
    tracker = UpdateRatioTracker(params, group_of, 2, window_bytes=window, primary=CPU)
    want = [lr * math.sqrt(sum(float(g.pow(2).sum()) for g, k in zip(grads, group_of) if k == layer)) /
            math.sqrt(sum(float(p.detach().pow(2).sum()) for p, k in zip(params, group_of) if k == layer))
            for layer in (0, 1)]
    got: dict[int, list[tuple[int, float]]] = {0: [], 1: []}
    for step in range(2 * tracker.sweep_steps):
        tracker.before_step()
        assert tracker.buffer_bytes() <= window + 64 * len(params)  # the window (plus piece alignment)
        _sgd_step(params, lr, grads)
        window_, sums = tracker.after_step()
        ratios = tracker.ratios(sums.double().numpy())
        for layer in (0, 1):
            if math.isfinite(ratios[layer]):
                got[layer].append((step, float(ratios[layer])))
    # layer 0 (520 elements) needs 3 windows of 200: published once per sweep; layer 1 fits in one window
    assert [s for s, _ in got[0]] == [tracker.sweep_steps - 1, 2 * tracker.sweep_steps - 1]
    assert len(got[1]) == 2
    for layer in (0, 1):
        for _, r in got[layer]:
            assert r == pytest.approx(want[layer], rel=1e-5)  # norms are reduced to float32


def test_full_mode_covers_everything_every_step():
    params = _params((5, 5), (5,))
    tracker = UpdateRatioTracker(params, [0, 1], 2, window_bytes=None, primary=CPU)
    assert tracker.full and tracker.sweep_steps == 1
    tracker.before_step()
    _sgd_step(params, 0.1, [torch.ones_like(p) for p in params])
    w, sums = tracker.after_step()
    assert np.isfinite(tracker.ratios(sums.double().numpy())).all()


def _train_ratios(mode, budget=None, steps=6):
    """(monitor, its step records, the bytes of its parameter copies before close released them);
    ``mon.hooks_before_close``: how many optimizer step hooks were registered while training."""
    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(steps, 2)
    mon = gradloc.watch(model, opt, update_ratio=mode, memory_budget_bytes=budget)
    for s in range(steps):
        mon.end_step(backward_step(model, data, s, mon))
        opt.step()
        opt.zero_grad()
    held = mon.update_ratios.buffer_bytes()
    mon.hooks_before_close = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    mon.close()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks  # detach removes them
    assert mon.update_ratios.buffer_bytes() == 0  # detach releases the copies
    return mon, list(mon.history), held


def test_small_models_get_every_layers_ratio_every_sweep_of_four_steps_by_default():
    mon, hist, held = _train_ratios("lean", steps=10)
    assert mon.hooks_before_close == 2  # the pre- and post-step hooks that measure the update
    sweep = mon.update_ratios.sweep_steps  # the 64 MiB floor holds this model: the quarter cap decides
    assert LEAN_SWEEP_STEPS <= sweep <= LEAN_SWEEP_STEPS + 1
    assert 0 < held <= mon.layer_stats.param_bytes() // LEAN_SWEEP_STEPS + 64 * len(mon.layer_stats.params)
    names = {s.layer for s in hist[0].layers}
    for start in range(0, len(hist) - sweep + 1, sweep):  # every layer once in each sweep's steps
        got = [s.layer for r in hist[start:start + sweep] for s in r.layers if s.update_ratio is not None]
        assert sorted(got) == sorted(names), start
    full, full_hist, _ = _train_ratios("full", steps=3)
    assert full.update_ratios.sweep_steps == 1 and all(s.update_ratio is not None for r in full_hist for s in r.layers)


def test_a_lean_budget_gives_every_layer_a_ratio_each_sweep_and_the_same_values_as_full():
    full_mon, full, full_held = _train_ratios("full", steps=8)
    param_bytes = full_mon.layer_stats.param_bytes()
    persistent = full_mon.layer_stats.persistent_bytes()
    budget = persistent + 64 * len(full_mon.layer_stats.params) + param_bytes // 3
    lean_mon, lean, lean_held = _train_ratios("lean", budget=budget, steps=8)
    sweep = lean_mon.update_ratios.sweep_steps
    assert 3 <= sweep <= 5
    assert 0 < lean_held <= budget - persistent  # the persistent copy stays within the budget
    assert full_held >= param_bytes
    names = {s.layer for s in full[0].layers}
    got: dict[str, list[tuple[int, float]]] = {}
    for rec in lean:
        for s in rec.layers:
            if s.update_ratio is not None:
                got.setdefault(s.layer, []).append((rec.step, s.update_ratio))
    assert set(got) == names, "every layer gets a ratio within a sweep"
    assert all(steps[0][0] < sweep for steps in got.values())
    by_step = {rec.step: {s.layer: s.update_ratio for s in rec.layers} for rec in full}
    tracker, cursor, whole = lean_mon.update_ratios, (0, 0), set()
    for _ in range(sweep):  # layers that one window covers entirely
        window, cursor = tracker._plan(cursor)
        whole |= {lean_mon.layer_stats.layers[i] for i in np.flatnonzero(window.layer_elems == tracker.layer_numel)}
    exact = 0
    for layer, values in got.items():
        for step, r in values:
            if layer in whole:  # measured at one step: the full copy's value
                assert r == pytest.approx(by_step[step][layer], rel=1e-4), (layer, step)
                exact += 1
            else:  # assembled over the steps of a sweep: the same order as the one-step values
                assert 0.3 * by_step[step][layer] < r < 3 * by_step[step][layer], (layer, step)
    assert exact > 0


def test_off_registers_no_optimizer_hook_and_keeps_no_copy():
    mon, hist, held = _train_ratios("off")
    assert mon.hooks_before_close == 0 and held == 0
    assert all(s.update_ratio is None for r in hist for s in r.layers)


@pytest.mark.parametrize("value,mode", [(True, "lean"), (False, "off"), ("full", "full")])
def test_update_ratio_accepts_bools(value, mode):
    assert gradloc.WatchConfig(update_ratio=value).update_ratio == mode


@pytest.mark.parametrize("bad", ["everything", 3, None])
def test_update_ratio_rejects_other_values(bad):
    with pytest.raises(gradloc.ConfigError, match="update_ratio"):
        gradloc.WatchConfig(update_ratio=bad)
