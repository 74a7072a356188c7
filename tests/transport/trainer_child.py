"""The trainer of the cross-process test: its own (spawned) process, a real model and optimizer,
``gradloc.watch`` with an :class:`AgentClient` sink pointed at the parent's server."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def train_and_send(address: str, job: str, steps: int, out: Any) -> None:
    """Train ``steps`` steps of TinyGPT, close the monitor (flushes the client), report to ``out``."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import gradloc
    from gradloc.config import WatchConfig
    from gradloc.transport import AgentClient
    from tests.helpers import backward_step, make_data, tiny_gpt

    model = tiny_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_data(steps, micro=2)
    client = AgentClient(address, job=job, rank=0, flush_interval_s=0.05)
    # the client is the sink under test: no in-process agent beside it (where this WatchConfig has one)
    solo = {"embedded": False} if "embedded" in WatchConfig.__dataclass_fields__ else {}
    mon = gradloc.watch(model, opt, sinks=[client], job=job, update_ratio=True, **solo)
    for s in range(steps):
        total = backward_step(model, data, s, mon)
        mon.end_step(total, probe=data.probe(model, s))
        opt.step()
        opt.zero_grad()
    mon.close()  # force_flush + shutdown of every sink
    out.put({"pid": os.getpid(), "counters": client.counters, "sink_errors": mon.counters["sink_errors"]})
