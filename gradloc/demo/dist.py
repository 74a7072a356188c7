"""The multi-rank demo: ``world_size`` ranks of one gloo job on this machine (DDP, FSDP2 or DeepSpeed).

The parent process spawns the ranks (:func:`gradloc.demo.spawn.run_ranks`); each runs the core demo
on its own data with the model wrapped by the backend, and rank 1 plants the culprit. gradloc
watches the job as one: the spike is detected on every rank at once, localized across the ranks
with the same ≤ 3 probes, and rank 0 emits the one incident, naming rank 1. Nothing here is a
simulation: the processes, the process group and the wrappers are the real ones.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any, Callable

from gradloc.demo.run import DemoConfig, DemoResult, run_demo
from gradloc.demo.spawn import TRAINING_PRELOAD, progress, run_ranks
from gradloc.errors import ConfigError
from gradloc.records import StepRecord

SECONDS_PER_STEP = 5.0  # the deadline's budget per step and rank (a 2-rank DDP step takes ~0.1 s here)
DEEPSPEED_SETUP_S = 420.0  # DeepSpeed's first run JIT-builds its shm comm op: 104-186 s measured here


def _rank_main(rank: int, world: int, cfg: DemoConfig) -> dict[str, Any]:
    """One rank (runs in a spawned process): the core demo under the backend; rank 0 reports progress.
    Its stdout goes to stderr: the parent's stdout carries only the demo's output (``--json``: one
    object), and frameworks print there (DeepSpeed's logger and its op builds do)."""
    sys.stdout.flush()
    os.dup2(2, 1)
    result = run_demo(replace(cfg, rank=rank), on_step=(lambda s, _: progress(s)) if rank == 0 else None)
    return {"planted": result.planted, "incidents": result.incidents if rank == 0 else [],
            "store_path": result.store_path if rank == 0 else None}


def run_distributed_demo(cfg: DemoConfig, on_step: Callable[[int, StepRecord | None], None] | None = None,
                         timeout_s: float | None = None) -> DemoResult:
    """Run the ``cfg.backend`` demo as ``cfg.world_size`` processes; the job's incidents come from rank 0.

    ``on_step(step, None)`` follows rank 0's progress. Raises :class:`gradloc.demo.spawn.SpawnError`
    when a rank fails or the job outlives ``timeout_s`` (default: 5 s per step)."""
    if cfg.backend is None:
        raise ConfigError("run_distributed_demo needs a backend (ddp, fsdp or deepspeed)")
    from gradloc.demo.data import cl100k_corpus

    setup = 120.0 + (DEEPSPEED_SETUP_S if cfg.backend == "deepspeed" else 0.0)
    deadline = timeout_s if timeout_s is not None else setup + SECONDS_PER_STEP * cfg.steps
    results = run_ranks(_rank_main, cfg.world_size, cfg, timeout_s=deadline, preload=TRAINING_PRELOAD,
                        on_progress=(lambda _, step: on_step(step, None)) if on_step else None)
    planted = [p for r in results for p in r["planted"]]
    return DemoResult(planted, results[0]["incidents"], [], cl100k_corpus().to_text, results[0]["store_path"])
