"""Two training runs in lockstep, each in its own process, for test_agent_faults.py.

Measuring a faulty run after a live one compares two windows a few seconds apart, and on a shared
2-core machine the same work takes 30-60 % longer in one window than in the next (measured: the
same live run's median gradloc time per step was 2.3, 2.7 and 4.2 ms in three runs in a row). So
the test runs both at once: the parent tells the live and the faulty trainer to take one step each,
alternately (which goes first alternates too), and both runs see the same machine. Each trainer is
its own process, with its own GIL and its own client thread, as a real training process would be.

The two clients differ in patience only, never in what the training thread does (one
``put_nowait`` per record either way). The faulty run's client is deliberately fragile (a 16-record
buffer, a 0.5 s call deadline, quick retries): its outages must drop records. The live control's
client is patient (the defaults: a 4,096-record buffer and a 5 s call deadline) and its monitor
closes with a generous budget (:data:`CONTROL_CLOSE_S`), so "the control delivered everything" does
not depend on how fast this machine's scheduler runs or its disk commits the daemon's SQLite writes.
With the faulty run's settings the control failed on a fresh CI machine in 3 runs of 3: the live
daemon acknowledged too slowly for a 1 s close budget, and the control counted 11-20 records not
delivered ("17 record(s) were not delivered"); with a 0.5 s call deadline and a 16-record buffer, a
daemon slow to acknowledge during the run would make it drop records as well. The faulty run keeps
the default close budget (1 s), and the test bounds its close.

Child protocol (``python -m tests.reliability.lockstep PORT OUT ROLE``, ROLE ``live`` or
``faulty``), one line each way, on stdin/stdout: ``step`` → ``<seconds of gradloc calls in that
step>``; ``close`` → a JSON object: the client's ``counters``, the monitor's ``undelivered`` at
close, ``close_s`` (how long ``Monitor.close`` took), the ``close_budget_s`` it had and the
``incidents`` the monitor raised (the parameters are saved to ``OUT``). Every read has a timeout.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import torch

import gradloc
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses
from gradloc.transport import AgentClient

ROOT = Path(__file__).resolve().parents[2]


CONTROL_CLOSE_S = 60.0  # the live control's close budget: generous, it must deliver everything
ROLES = ("live", "faulty")


def client(port: int, role: str) -> AgentClient:
    """The faulty run's client: a deliberately small buffer and quick retries (the outages in the
    test must drop records). The live control's: the default buffer and call deadline (a live
    daemon that is slow on a loaded machine must not make it drop)."""
    if role == "live":
        return AgentClient(f"127.0.0.1:{port}", job="faults", rank=0, backoff_initial_s=0.02, backoff_max_s=0.2)
    return AgentClient(f"127.0.0.1:{port}", job="faults", rank=0, queue_size=16, backoff_initial_s=0.02,
                       backoff_max_s=0.2, timeout_s=0.5)


class Trainer:
    """The tiny GPT of the test, one optimizer step at a time; times only gradloc's own calls
    (``micro_batch`` enter/exit and ``end_step``): the training compute does not depend on the agent."""

    def __init__(self, sink: AgentClient | None, close_timeout_s: float = 1.0) -> None:
        torch.manual_seed(0)
        self.model = TinyGPT(GPTConfig(vocab=64, seq=16, d_model=32, n_layers=2, n_heads=4))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(1)
        self.mon = gradloc.watch(self.model, self.opt, sinks=[sink], embedded=False, job="faults",
                                 close_timeout_s=close_timeout_s) if sink else None

    def step(self) -> float:
        spent = 0.0
        for _ in range(2):
            x = torch.randint(64, (4, 16), generator=self.gen)
            t0 = time.perf_counter()
            block = self.mon.micro_batch(x) if self.mon is not None else None
            if block is not None:
                block.__enter__()
            spent += time.perf_counter() - t0
            token_losses(self.model(x), x).mean().backward()
            t0 = time.perf_counter()
            if block is not None:
                block.__exit__(None, None, None)
            spent += time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.mon is not None:
            self.mon.end_step()
        spent += time.perf_counter() - t0
        self.opt.step()
        self.opt.zero_grad()
        return spent

    def close(self) -> dict[str, torch.Tensor]:
        if self.mon is not None:
            self.mon.close()
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


class Child:
    """The parent's handle on one trainer process."""

    def __init__(self, port: int, out: Path, log: Path, role: str) -> None:
        assert role in ROLES, role
        self.out = out
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.reliability.lockstep", str(port), str(out), role],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, bufsize=0,
                                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        self.log = log
        self._ask("ready", 120)

    def step(self) -> float:
        return float(self._ask("step", 60))

    def close(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The parameters and the child's close report (see the module docstring)."""
        report = json.loads(self._ask("close", CONTROL_CLOSE_S + 60))
        self.proc.wait(30)
        return torch.load(self.out), report

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def _ask(self, what: str, timeout_s: float) -> str:
        if what != "ready":
            self.proc.stdin.write(f"{what}\n".encode())
        line, deadline = b"", time.monotonic() + timeout_s
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = self.proc.stdout.read(1) if ready else b""
            if not chunk:
                self.kill()
                raise AssertionError(f"trainer gave no answer to {what!r} within {timeout_s} s:\n{self.log.read_text()}")
            line += chunk
        return line.decode().strip()


def main(port: int, out: str, role: str) -> None:
    torch.set_num_threads(1)
    sink = client(port, role)
    budget = CONTROL_CLOSE_S if role == "live" else gradloc.WatchConfig().close_timeout_s
    trainer = Trainer(sink, budget)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "step":
            print(repr(trainer.step()), flush=True)
        elif line.strip() == "close":
            t0 = time.monotonic()
            params = trainer.close()
            close_s = time.monotonic() - t0
            torch.save(params, out)
            mon = trainer.mon
            print(json.dumps({"counters": sink.counters, "undelivered": mon.counters["undelivered_at_close"],
                              "close_s": close_s, "close_budget_s": budget, "incidents": len(mon.incidents)}),
                  flush=True)
            return


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
