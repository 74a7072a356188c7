"""Run a function as the W ranks of one gloo job, under a deadline that can never hang the caller.

``run_ranks(fn, world_size, *args, timeout_s=...)`` spawns W fresh interpreters (``spawn`` start
method: no forked torch state; with ``preload``, forks of a server that imported only those modules),
each with the environment a launcher sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT —
what DeepSpeed needs to skip mpi4py), a gloo process group on a free local port and one torch thread,
then calls ``fn(rank, world_size, *args)``; results come back by value. A rank that raises fails the
run with its traceback, a rank that dies fails it with its exit code, and when the deadline passes
(ranks stuck in different collectives) every process is killed and the run fails naming the ranks
that had not finished. The demo's ``--world-size N --backend …`` and ``bench overhead --ddp N`` run on
it, and so do the distributed tests.

``progress(value)`` inside a rank sends ``value`` to the parent's ``on_progress(rank, value)``.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

from gradloc.errors import GradlocError

_OUT: Any = None  # the child's queue to the parent (set in the child only)

# What every training rank imports before its first step, for ``preload``: torch, its distributed package and
# torch._dynamo — which the first ``optimizer.step()`` imports anyway (torch's optimizers are wrapped in
# ``torch._disable_dynamo``, imported on first call): ~13 s of a rank's start on a 2-core box, 8 s of it dynamo.
# None of these reads a variable a launcher sets (RANK, MASTER_PORT, ...) at import, starts a thread or touches CUDA.
# For ranks that do not compile: inductor compiled slower in forks of a server that had imported dynamo
# (tests/defaults/test_ddp.py's torch.compile(DDP(model)) ranks: 29 s -> 46 s), so the test suite's launcher
# preloads torch and transformers without it. The demo's 4 tp ranks: 72 s -> 60 s with this list (one A/B).
TRAINING_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch.optim", "torch._dynamo", "numpy",
                    "gradloc")


class SpawnError(GradlocError, RuntimeError):
    """A rank raised, died, or the job did not finish before its deadline."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def progress(value: Any) -> None:
    """From inside a rank: hand ``value`` to the parent's ``on_progress`` (never blocks, never raises)."""
    if _OUT is not None:
        try:
            _OUT.put_nowait((int(os.environ.get("RANK", "0")), "progress", value))
        except Exception:  # noqa: BLE001 - progress is best effort
            pass


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, out: Any, env: dict,
           init: bool, paths: list[str]) -> None:
    global _OUT
    _OUT = out
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1", **env})
    sys.path[:0] = [p for p in paths if p not in sys.path]
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        result = fn(rank, world, *args)
        out.put((rank, "ok", pickle.dumps(result)))  # by value: torch's queue would share tensors by fd
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        out.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240.0,
              env: dict[str, str] | None = None, may_die: tuple[int, ...] = (), init: bool = True,
              on_progress: Callable[[int, Any], None] | None = None, paths: tuple[str, ...] = (),
              preload: tuple[str, ...] = ()) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` processes; their return values by rank.

    ``fn`` must be importable by name in a fresh interpreter (a module-level function); ``paths``
    are put first on the children's ``sys.path``. ``may_die``: ranks expected to crash (their result
    is None). ``init=False``: no process group (the function makes its own).

    ``preload``: modules imported once by a fork server (``forkserver`` start method) whose forks become
    the ranks, instead of fresh interpreters that each import them again (the demo and the benchmarks pass
    :data:`TRAINING_PRELOAD`, the test suite its own list: torch and dynamo cost a rank ~13 s of imports on a
    2-core box, paid once by the server instead of W times). The server imports nothing else and starts no
    thread; ``env`` is applied in each rank, so a variable read at import time must belong to a module not
    preloaded. The first preload list of a process is the one
    its fork server keeps."""
    if world_size < 1:
        raise SpawnError(f"world_size must be >= 1, got {world_size}")
    if preload:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
    else:
        ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, out, env or {}, init, list(paths)),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise SpawnError(f"ranks {missing} did not finish within {timeout_s:.0f} s (a deadlock?)")
            try:
                rank, status, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                _check_dead(procs, results, may_die)
                continue
            if status == "progress":
                if on_progress is not None:
                    on_progress(rank, value)
            elif status == "error":
                raise SpawnError(f"rank {rank} failed:\n{value}")
            else:
                results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [results[r] for r in range(world_size)]


def _check_dead(procs: list[Any], results: dict[int, Any], may_die: tuple[int, ...]) -> None:
    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and p.exitcode is not None]
    for r in [r for r in dead if r in may_die]:
        results[r] = None
    dead = [r for r in dead if r not in may_die]
    if dead:
        raise SpawnError(f"rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
