"""gradloc's own cost per step, and shedding optional work to stay within a budget.

What is timed: the per-token forward and backward hooks, the micro-batch blocks' bookkeeping,
``end_step`` (everything but a spike's localization probes, which are reported per incident), and
the optimizer pre/post hooks of the update ratios. On CPU each section is timed with
``perf_counter``. On CUDA, host time is not device time (kernels run asynchronously), so every
``cuda_every``-th step records CUDA events around the same sections and reads them after that
step's host transfer (which has synchronized the stream): no extra synchronization, and the cost
of the events falls on one step in ``cuda_every``.

The step's own time is the wall time from one ``end_step`` to the next. The exported ratio is an
EMA of gradloc seconds / (step seconds − gradloc seconds): 0.04 means training steps take 4% longer.

Shedding (``WatchConfig.max_overhead``): every ``window`` steps the EMA is compared with the
budget. Above it, the next optional feature in :data:`SHED_ORDER` is shed; below half of it, the
last shed feature is restored, at most once per ``retry`` steps (doubled each time a restore has
to be undone). Detection is never shed.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from gradloc.records import SHED_FEATURES as SHED_ORDER


class OverheadMeter:
    def __init__(self, budget: float | None, *, cuda: bool = False, alpha: float = 0.9,
                 window: int = 20, retry: int = 200, cuda_every: int = 16,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget, self.cuda, self.alpha, self.clock = budget, cuda, alpha, clock
        self.window, self.retry, self.cuda_every = window, retry, cuda_every
        self.level = 0  # features shed: SHED_ORDER[:level]
        self.ema: float | None = None
        self._cpu = 0.0
        self._events: list[tuple[Any, Any]] | None = None
        self._last_end: float | None = None
        self._excluded = 0.0
        self._steps = 0
        self._since_change = 0
        self._restored_at: int | None = None

    @property
    def shed(self) -> tuple[str, ...]:
        return SHED_ORDER[: self.level]

    def is_shed(self, feature: str) -> bool:
        return feature in SHED_ORDER[: self.level]

    # -- timing sections (hot path: a few hundred calls a step) -------------------------------
    def begin(self) -> Any:
        if self._events is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self.clock()

    def end(self, token: Any) -> None:
        if isinstance(token, float):
            self._cpu += self.clock() - token
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        if self._events is not None:
            self._events.append((token, ev))

    def exclude(self, seconds: float) -> None:
        """Wall time not to count as training (a spike's localization probes, reported per incident)."""
        self._excluded += seconds

    # -- per step ---------------------------------------------------------------------------------
    def finish_step(self) -> tuple[float | None, float | None, float | None]:
        """Close the interval since the last call (after the step's host transfer, which has
        synchronized the device): (gradloc seconds, step seconds, smoothed ratio)."""
        now = self.clock()
        step_s = None if self._last_end is None else max(now - self._last_end - self._excluded, 0.0)
        own: float | None = self._cpu
        if self.cuda:
            own = _elapsed_s(self._events) if self._events is not None else None
            self._events = [] if (self._steps + 1) % self.cuda_every == 0 else None
        self._cpu, self._excluded = 0.0, 0.0
        self._last_end = now
        self._steps += 1
        if own is not None and step_s is not None and step_s > own:
            ratio = own / (step_s - own)
            self.ema = ratio if self.ema is None else self.alpha * self.ema + (1 - self.alpha) * ratio
        self._adapt()
        return own, step_s, self.ema

    def _adapt(self) -> None:
        self._since_change += 1
        if self.budget is None or self.ema is None or self._since_change < self.window:
            return
        if self.ema > self.budget and self.level < len(SHED_ORDER):
            if self._restored_at is not None and self._steps - self._restored_at <= 2 * self.window:
                self.retry = min(self.retry * 2, 100_000)  # the restore did not hold: wait longer next time
            self._change(+1)
        elif self.ema < self.budget / 2 and self.level > 0 and self._since_change >= self.retry:
            self._change(-1)
            self._restored_at = self._steps

    def _change(self, delta: int) -> None:
        self.level += delta
        self.ema = None  # measure the new level afresh
        self._since_change = 0


def _elapsed_s(events: list[tuple[Any, Any]]) -> float | None:
    """Σ of CUDA event intervals in seconds; None if any has not completed (nothing is waited for)."""
    if not all(b.query() for _, b in events):
        return None
    return sum(a.elapsed_time(b) for a, b in events) / 1e3
