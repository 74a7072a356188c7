"""The optimizer hooks that measure update-to-weight ratios, and the update they leave behind.

``optimizer.step()`` runs after ``end_step``: its post-hook's device sums belong to the record that
``end_step`` is holding back (the monitor's pending record), which goes out with the next
``end_step`` (or ``close``) carrying its ratios. A hook that fails is counted
(``update_ratio_errors``), never raised into training; a shed ``update_ratio`` feature skips them.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import numpy as np
import torch

from gradloc.collector.overhead import OverheadMeter
from gradloc.collector.update_ratio import UpdateRatioTracker, Window
from gradloc.engine.fanout import guarded


class UpdateHooks:
    def __init__(self, tracker: UpdateRatioTracker, meter: OverheadMeter, counters: Counter[str],
                 pending_step: Callable[[], int | None]) -> None:
        self.tracker, self.meter, self.counters = tracker, meter, counters
        self._pending_step = pending_step  # the step of the record the next update belongs to, if any
        self._update: tuple[int, Window, torch.Tensor] | None = None  # (record step, window, device sums)
        self._handles: list[Any] = []

    def attach(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is not None and self.tracker.enabled:
            self._handles = [optimizer.register_step_pre_hook(self._before),
                             optimizer.register_step_post_hook(self._after)]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.tracker.release()

    def take(self, step: int | None) -> tuple[Window, torch.Tensor] | None:
        """The update measured for the record of ``step`` (None: none, or it was for another step)."""
        upd, self._update = self._update, None
        return upd[1:] if upd is not None and step is not None and upd[0] == step else None

    def host_ratios(self, step: int | None, sharded: bool) -> np.ndarray | None:
        """At close: the ratios of ``step``'s update, computed on the host (none when sharded: the
        other ranks' sums would arrive only with a next step's gather)."""
        upd = self.take(step)
        if upd is None or sharded:
            return None
        return self.tracker.ratios(upd[1].double().cpu().numpy())

    def _before(self, *_: Any) -> None:
        if self.meter.is_shed("update_ratio"):
            return
        t0 = self.meter.begin()
        guarded(self.counters, "update_ratio_errors", self.tracker.before_step)
        self.meter.end(t0)

    def _after(self, *_: Any) -> None:
        t0 = self.meter.begin()
        try:
            got = self.tracker.after_step()
            step = self._pending_step()
            if got is not None and step is not None:
                self._update = (step, *got)
        except Exception:
            self.counters["update_ratio_errors"] += 1
        self.meter.end(t0)
