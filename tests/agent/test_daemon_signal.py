"""``Daemon.serve_until_signal``: SIGTERM / SIGINT stop the daemon once, and the handler takes no lock (an
``Event.set()`` in the handler deadlocked a daemon in CI: the signal landed while the main thread held the
event's condition lock inside ``Event.wait``, and the handler, on that same thread, waited for it forever)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from gradloc.agent.daemon import Daemon


class _Stub:
    def __init__(self) -> None:
        self.stops = 0

    def stop(self) -> None:
        self.stops += 1


@pytest.mark.wallclock  # asserts a wall-clock bound (tests/conftest.py: never beside a multi-process test)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_it_once_and_restores_the_handlers(signum):
    before = signal.getsignal(signum)
    stub = _Stub()
    sent = threading.Event()

    def send() -> None:
        time.sleep(0.3)
        os.kill(os.getpid(), signum)  # delivered to the main thread, which sits in serve_until_signal
        sent.set()

    threading.Thread(target=send, daemon=True).start()
    t0 = time.monotonic()
    Daemon.serve_until_signal(stub)  # type: ignore[arg-type]
    assert sent.wait(10) and time.monotonic() - t0 < 10
    assert stub.stops == 1
    assert signal.getsignal(signum) == before


def test_the_handler_takes_no_lock():
    """A real SIGTERM during the wait: its handler, run on the main thread, enters no ``threading.Condition`` (what an
    ``Event.set()`` does first, and where the deadlock was): it only records the signal."""
    entered, inside, wrapped = [], [], set()
    real_signal, real_enter = signal.signal, threading.Condition.__enter__

    def spy(signum, handler):  # noqa: ANN001, ANN202
        if signum in wrapped or not callable(handler):
            return real_signal(signum, handler)
        wrapped.add(signum)

        def traced(s, frame):  # noqa: ANN001, ANN202
            inside.append(s)
            try:
                return handler(s, frame)
            finally:
                inside.pop()
        return real_signal(signum, traced)

    def recording_enter(cond):  # noqa: ANN001, ANN202
        if inside:
            entered.append(cond)
        return real_enter(cond)

    def send() -> None:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)

    stub = _Stub()
    signal.signal, threading.Condition.__enter__ = spy, recording_enter
    try:
        threading.Thread(target=send, daemon=True).start()
        Daemon.serve_until_signal(stub)  # type: ignore[arg-type]
    finally:
        signal.signal, threading.Condition.__enter__ = real_signal, real_enter
    assert entered == [] and stub.stops == 1
