"""The monitor's sink fan-out: a failing sink is counted and skipped, never raised; close is bounded."""
from __future__ import annotations

from collections import Counter

import pytest

from gradloc.engine.fanout import Fanout


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.fail:
            raise RuntimeError(f"{name} broke")

    def on_step(self, record: object) -> None:
        self._call("step")

    def on_incident(self, incident: object) -> None:
        self._call("incident")

    def force_flush(self) -> None:
        self._call("flush")

    def shutdown(self) -> None:
        self._call("shutdown")


class Bounded(Recorder):
    def __init__(self, lost: int | Exception) -> None:
        super().__init__()
        self.lost, self.given = lost, None

    def close_within(self, timeout_s: float) -> int:
        self.given = timeout_s
        if isinstance(self.lost, Exception):
            raise self.lost
        return self.lost


def test_a_failing_sink_is_counted_and_the_others_still_get_every_call(caplog: pytest.LogCaptureFixture) -> None:
    counters: Counter[str] = Counter()
    bad, good = Recorder(fail=True), Recorder()
    fan = Fanout([bad, good], counters)
    fan.on_step(object())
    fan.on_incident(object())
    fan.close(1.0)
    assert good.calls == bad.calls == ["step", "incident", "flush", "shutdown"]
    assert counters["sink_errors"] == 4
    assert "Recorder.on_step failed" in caplog.text


def test_close_shares_one_deadline_and_counts_what_was_not_delivered() -> None:
    counters: Counter[str] = Counter()
    first, broken, last = Bounded(3), Bounded(RuntimeError("down")), Bounded(0)
    Fanout([first, broken, last], counters).close(0.5)
    assert 0 < last.given <= first.given <= 0.5  # what is left of the one timeout, never more
    assert counters["undelivered_at_close"] == 3 and counters["sink_errors"] == 1
    assert first.calls == [] and last.calls == []  # close_within replaces force_flush + shutdown
