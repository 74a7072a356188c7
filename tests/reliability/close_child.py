"""A trainer process for test_close.py: ``python -m tests.reliability.close_child ADDRESS HOW BUDGET RPC``.

Trains a few steps shipping to the agent at ADDRESS through an :class:`AgentClient` whose calls
have a deadline of RPC seconds, with ``close_timeout_s=BUDGET``; then closes the monitor
(``HOW == "close"``) or leaves it open (``"exit"``: interpreter exit must close it). Prints one
JSON line at exit: the monotonic times training ended (``trained_at``) and the monitor was closed
(``closed_at``: after ``Monitor.close`` returned, or after the monitor's own exit handler ran),
``close_s`` for an explicit close, and ``undelivered`` (``counters["undelivered_at_close"]``).
"""
from __future__ import annotations

import atexit
import json
import sys
import time

import torch

import gradloc
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses
from gradloc.transport import AgentClient


def _report(out: dict) -> None:
    out.setdefault("closed_at", time.monotonic())  # "exit": the monitor's exit handler ran just before
    mon = out.pop("monitor")
    out["undelivered"] = mon.counters["undelivered_at_close"]
    print(json.dumps(out), flush=True)


def main(address: str, how: str, budget_s: float, rpc_timeout_s: float) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out: dict = {}
    # registered before watch(): exit handlers run last-in first-out, so this one runs after the
    # monitor's own (which closes it at interpreter exit)
    atexit.register(_report, out)
    model = TinyGPT(GPTConfig(vocab=64, seq=8, d_model=16, n_layers=1, n_heads=2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    client = AgentClient(address, job="close-child", rank=0, timeout_s=rpc_timeout_s)
    mon = gradloc.watch(model, opt, sinks=[client], embedded=False, job="close-child", close_timeout_s=budget_s)
    out["monitor"] = mon  # alive until exit, as in a training script
    for _ in range(3):
        x = torch.randint(64, (2, 8))
        with mon.micro_batch(x):
            token_losses(model(x), x).mean().backward()
        mon.end_step()
        opt.step()
        opt.zero_grad()
    out["trained_at"] = time.monotonic()
    if how == "close":
        mon.close()
        out["closed_at"] = time.monotonic()
        out["close_s"] = out["closed_at"] - out["trained_at"]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
