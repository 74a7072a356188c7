"""Run a function in W processes of one gloo job, under a deadline that can never hang the suite.

``run(fn, world_size, *args, timeout_s=...)`` spawns W fresh interpreters (``spawn`` start method:
no forked torch state), each initialising ``torch.distributed`` with gloo on a free local port and
the environment a launcher would set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT — what
DeepSpeed needs to skip mpi4py), then calling ``fn(rank, world_size, *args)``. Each process returns
its result through a queue. If any process raises, the others are killed and the test fails with
that traceback; if the deadline passes (a deadlock: ranks in different collectives), every process
is killed and the test fails naming the ranks that had not finished. One torch thread per process.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, out: Any, env: dict) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1", **env})
    sys.path.insert(0, ROOT)
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if not env.get("GRADLOC_TEST_NO_INIT"):
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        result = fn(rank, world, *args)
        out.put((rank, "ok", pickle.dumps(result)))  # by value: torch's queue would share tensors by fd
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        out.put((rank, "error", traceback.format_exc()))


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240.0,
        env: dict[str, str] | None = None, may_die: tuple[int, ...] = ()) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` processes; their return values by rank.

    ``may_die``: ranks a test makes crash on purpose; their result is None."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, out, env or {}), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise AssertionError(f"ranks {missing} did not finish within {timeout_s:.0f} s (a deadlock?)")
            try:
                rank, status, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and p.exitcode is not None]
                for r in [r for r in dead if r in may_die]:
                    results[r] = None
                dead = [r for r in dead if r not in may_die]
                if dead:
                    raise AssertionError(f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [results[r] for r in range(world_size)]
