"""A monitor's records out: each step's record held until the next optimizer step has measured its update ratios,
then kept in ``history`` and sent to the sinks, each call guarded (a sink that raises is counted, ``sink_errors``,
and logged, never raised into training); closing waits on the network at most ``close_timeout_s`` in all."""
from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np

from gradloc.collector.step import Assembled, with_update_ratios
from gradloc.records import Incident, StepRecord, event_counts
from gradloc.sinks import Sink

log = logging.getLogger("gradloc")


def guarded(counters: Counter[str], key: str, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)``; an exception is counted under ``key`` and logged, not raised."""
    try:
        fn(*args)
    except Exception:
        counters[key] += 1
        log.warning("gradloc: %s failed", getattr(fn, "__qualname__", fn), exc_info=True)


class Fanout:
    def __init__(self, sinks: Sequence[Sink], counters: Counter[str], history: int = 256) -> None:
        self.sinks: list[Sink] = list(sinks)
        self.counters = counters  # the monitor's
        self.history: deque[StepRecord] = deque(maxlen=history)  # the records sent, last ``history``
        self.held: Assembled | None = None  # the last step, waiting for its update ratios

    @property
    def held_step(self) -> int | None:
        return self.held.record.step if self.held is not None else None

    def hold(self, assembled: Assembled) -> None:
        """Keep the step until the next one measured its update ratios (``release``)."""
        self.held = assembled

    def release(self, ratios: np.ndarray | None, layers: Sequence[str]) -> None:
        """The held step's record, with its update ratios and the cumulative event counts (records/events.py), into
        ``history`` and to the sinks."""
        if self.held is None:
            return
        rec = self.held.record
        if ratios is not None:
            rec = with_update_ratios(rec, layers, ratios)
        if self.counters:
            rec = replace(rec, events=event_counts(self.counters))
        self.held = None
        self.history.append(rec)
        self.on_step(rec)

    def on_step(self, record: StepRecord) -> None:
        for sink in self.sinks:
            guarded(self.counters, "sink_errors", sink.on_step, record)

    def on_incident(self, incident: Incident) -> None:
        for sink in self.sinks:
            guarded(self.counters, "sink_errors", sink.on_incident, incident)

    def close(self, timeout_s: float) -> None:
        """Flush and shut down every sink. A sink that talks to a daemon (``close_within``) gets what
        is left of ``timeout_s``; what it could not deliver is counted (``undelivered_at_close``)."""
        deadline = time.monotonic() + timeout_s
        for sink in self.sinks:
            bounded = getattr(sink, "close_within", None)
            if bounded is None:  # local sinks (JSONL file, embedded agent): no network to wait on
                guarded(self.counters, "sink_errors", sink.force_flush)
                guarded(self.counters, "sink_errors", sink.shutdown)
                continue
            try:
                lost = bounded(max(deadline - time.monotonic(), 0.0))
            except Exception:
                self.counters["sink_errors"] += 1
                log.warning("gradloc: closing %s failed", type(sink).__name__, exc_info=True)
                continue
            if lost:
                self.counters["undelivered_at_close"] += lost
                log.warning("gradloc: %d record(s) were not delivered to the agent (down, stalled or slow; "
                            "close_timeout_s=%g)", lost, timeout_s)
