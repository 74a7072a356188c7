"""A trainer process for test_close.py: trains a few steps shipping to ``argv[1]`` (an agent address),
then leaves the monitor open (``argv[2] == "exit"``: interpreter exit must close it) or closes it.
Prints one JSON line: the monotonic time training ended and, after close, how long it took."""
from __future__ import annotations

import json
import sys
import time

import torch

import gradloc
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses


def main(address: str, how: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=64, seq=8, d_model=16, n_layers=1, n_heads=2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = gradloc.watch(model, opt, agent=address, job="close-child", store=False)
    for _ in range(3):
        x = torch.randint(64, (2, 8))
        with mon.micro_batch(x):
            token_losses(model(x), x).mean().backward()
        mon.end_step()
        opt.step()
        opt.zero_grad()
    out = {"trained_at": time.monotonic()}
    if how == "close":
        t0 = time.monotonic()
        mon.close()
        out["close_s"] = time.monotonic() - t0
        out["undelivered"] = mon.counters["undelivered_at_close"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
