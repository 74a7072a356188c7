"""The distributed tests' launcher: :func:`gradloc.demo.spawn.run_ranks`, failing the test instead.

``run(fn, world_size, *args, timeout_s=...)`` runs ``fn(rank, world_size, *args)`` as the W ranks of
a gloo job (fresh interpreters, one torch thread, a hard deadline). A rank that raises, dies or is
still running at the deadline (a deadlock) fails the test with an AssertionError naming it — the
suite never hangs.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from gradloc.demo.spawn import SpawnError, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Imported once by the suite's fork server; each rank is a fork of it (run_ranks' ``preload``). Nothing here
# reads a variable a test sets through ``env`` at import (DeepSpeed, Megatron and Accelerate are not preloaded).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.nn.parallel", "numpy", "gradloc",
           "transformers", "transformers.models.llama.modeling_llama")


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240.0,
        env: dict[str, str] | None = None, may_die: tuple[int, ...] = ()) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` processes; their return values by rank.

    ``may_die``: ranks a test makes crash on purpose; their result is None. ``GRADLOC_TEST_NO_INIT``
    in ``env``: no process group (the test makes its own)."""
    env = env or {}
    try:
        return run_ranks(fn, world_size, *args, timeout_s=timeout_s, env=env, may_die=may_die,
                         init=not env.get("GRADLOC_TEST_NO_INIT"), paths=(ROOT,), preload=PRELOAD)
    except SpawnError as exc:
        raise AssertionError(str(exc)) from None
