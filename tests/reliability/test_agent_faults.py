"""Training never waits on the agent and never changes its numbers while the agent misbehaves.

One training run ships to a real daemon on a fixed port that is absent at start, started, killed
with SIGKILL, restarted, stopped with SIGSTOP and resumed, at fixed steps. Against the same run
with a live daemon throughout, measured in this test: the median time gradloc's own calls take
per step (``micro_batch`` blocks' enter/exit and ``end_step``: the training compute does not depend
on the agent) differs by < 1 ms; the client reconnected and resumed (the last daemon has the job's
records); the records the client had to drop are counted (a deliberately small client buffer)
and exported (``gradloc_client_dropped_total`` on the last daemon). The parameters after the faulty
run are bitwise those of the same seed without gradloc. Real daemon processes, real signals.
"""
from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

import pytest
import torch

import gradloc
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses
from gradloc.demo.spawn import free_port
from gradloc.transport import AgentClient
from tests.reliability.daemon import metrics_text, start_daemon

pytestmark = pytest.mark.integration
STEPS = 120
START, KILL, RESTART, STOP, CONT = 20, 50, 70, 90, 105  # the faulty run's schedule (steps)


def _train(sink: AgentClient | None, on_step=None) -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=64, seq=16, d_model=32, n_layers=2, n_heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    mon = gradloc.watch(model, opt, sinks=[sink], embedded=False, job="faults") if sink is not None else None
    own: list[float] = []
    for s in range(STEPS):
        if on_step is not None:
            on_step(s)
        spent = 0.0
        for _ in range(2):
            x = torch.randint(64, (4, 16), generator=g)
            t0 = time.perf_counter()
            block = mon.micro_batch(x) if mon is not None else None
            if block is not None:
                block.__enter__()
            spent += time.perf_counter() - t0
            token_losses(model(x), x).mean().backward()
            t0 = time.perf_counter()
            if block is not None:
                block.__exit__(None, None, None)
            spent += time.perf_counter() - t0
        t0 = time.perf_counter()
        if mon is not None:
            mon.end_step()
        own.append(spent + time.perf_counter() - t0)
        opt.step()
        opt.zero_grad()
    if mon is not None:
        mon.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, own


def _client(port: int) -> AgentClient:
    return AgentClient(f"127.0.0.1:{port}", job="faults", rank=0, queue_size=16, backoff_initial_s=0.02,
                       backoff_max_s=0.2, timeout_s=0.5)


def test_training_is_unaffected_by_an_absent_killed_stalled_agent(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    plain, _ = _train(None)
    live_port = free_port()
    live = start_daemon(tmp_path / "live.db", live_port, tmp_path, 100)
    try:
        _, live_own = _train(_client(live_port))
    finally:
        live.send_signal(signal.SIGTERM)
        live.wait(30)

    port, db = free_port(), tmp_path / "faulty.db"
    procs: dict[str, object] = {}

    def schedule(step: int) -> None:
        if step in (START, RESTART):
            procs["d"] = start_daemon(db, port, tmp_path, step)
        elif step == KILL:
            procs["d"].send_signal(signal.SIGKILL)
            procs["d"].wait(30)
        elif step == STOP:
            os.kill(procs["d"].pid, signal.SIGSTOP)
        elif step == CONT:
            os.kill(procs["d"].pid, signal.SIGCONT)

    client = _client(port)
    try:
        params, faulty_own = _train(client, schedule)
        text = metrics_text(tmp_path, RESTART)
    finally:
        d = procs.get("d")
        if d is not None and d.poll() is None:
            os.kill(d.pid, signal.SIGCONT)
            d.send_signal(signal.SIGTERM)
            d.wait(30)
    added_ms = (statistics.median(faulty_own) - statistics.median(live_own)) * 1e3
    print(f"gradloc per step: live {statistics.median(live_own) * 1e3:.3f} ms, faulty "
          f"{statistics.median(faulty_own) * 1e3:.3f} ms (added {added_ms:+.3f} ms); client {client.counters}")
    assert added_ms < 1.0, added_ms
    for name, p in plain.items():
        assert torch.equal(p, params[name]), f"{name} differs from the run without gradloc"
    c = client.counters
    assert c["reconnects"] >= 1 and c["sent_steps"] > 0
    dropped = c["send_failed"] + c["queue_full"]
    assert dropped > 0, c  # a 16-record buffer over 20-step outages must have dropped some, and said so
    assert 'gradloc_client_dropped_total{job="faults"' in text, "the drops were not exported"
    assert 'job="faults"' in text and "gradloc_last_record_timestamp_seconds" in text
