"""The optimizer hooks that measure update ratios: failures are counted and never reach
``optimizer.step()``; an update is handed only to the record of the step it was measured for."""
from __future__ import annotations

from collections import Counter

import torch

from gradloc.collector.overhead import OverheadMeter
from gradloc.engine.update_hooks import UpdateHooks


class Tracker:
    """Stands in for UpdateRatioTracker (whose own tests are tests/collector/test_update_ratio.py)."""

    enabled = True

    def __init__(self, fail: bool) -> None:
        self.fail, self.released = fail, False

    def before_step(self) -> None:
        if self.fail:
            raise RuntimeError("before")

    def after_step(self) -> tuple[str, torch.Tensor]:
        if self.fail:
            raise RuntimeError("after")
        return "window", torch.ones(2)

    def ratios(self, sums):  # noqa: ANN001, ANN201
        return sums * 2

    def release(self) -> None:
        self.released = True


def _optimizer() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.5)
    return p, torch.optim.SGD([p], lr=0.1)


def test_failing_hooks_are_counted_and_the_optimizer_step_still_happens() -> None:
    counters: Counter[str] = Counter()
    p, opt = _optimizer()
    hooks = UpdateHooks(Tracker(fail=True), OverheadMeter(None), counters, lambda: 7)
    hooks.attach(opt)
    opt.step()
    assert counters["update_ratio_errors"] == 2
    assert torch.equal(p.detach(), torch.full((3,), 0.95))
    assert hooks.take(7) is None
    hooks.detach()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_an_update_goes_only_to_the_record_it_was_measured_for() -> None:
    pending: list[int | None] = [None]
    _, opt = _optimizer()
    hooks = UpdateHooks(Tracker(fail=False), OverheadMeter(None), Counter(), lambda: pending[0])
    hooks.attach(opt)
    opt.step()  # no record held back: nothing to attach the update to
    assert hooks.take(None) is None
    pending[0] = 4
    opt.step()
    assert hooks.take(5) is None and hooks.take(4) is None  # the wrong step's take drops it
    opt.step()
    window, sums = hooks.take(4)
    assert window == "window" and torch.equal(sums, torch.ones(2))
    opt.step()
    assert hooks.host_ratios(4, sharded=True) is None
    opt.step()
    assert hooks.host_ratios(4, sharded=False).tolist() == [2.0, 2.0]  # float64 host sums, then ratios()
